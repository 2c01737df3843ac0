"""The Hydra entry point with a teacher whose tokenizer differs from the student's: conf/cross_tokenizer composes
into method.cross_tokenizer, a BPE teacher trains through the cross-tokenizer loss, and what that loss cannot do is
refused before any model loads."""

import csv
from pathlib import Path

import pytest
from helpers.hydra_compose import compose_train
from hydra.errors import InstantiationException
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from lightning_gkd.cli.train import build, run
from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer
from lightning_gkd.losses.cross_tokenizer import CrossTokenizerDistillation
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_TEACHER, tiny_causal_lm

FAST = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.val_batch_size=4",
    "method.sampling.max_new_tokens=6",
    "method.validation.metrics={}",
    "callbacks=none",
    "export=false",
    "print_config=false",
]


@pytest.fixture(scope="module")
def bpe_folders(tmp_path_factory):
    """A tiny teacher over a BPE tokenizer: ``teacher/`` (model and tokenizer), ``bare/`` (the model only) and
    ``tokenizer/``."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = [m["content"] for row in addition_rows("train", 64) for m in row["messages"]]
    tokenizer = build_chatml_bpe_tokenizer(corpus, merges=60)
    teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)
    for name in ("teacher", "bare"):
        teacher.save_pretrained(root / name)
    tokenizer.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "tokenizer")
    return root


@pytest.fixture()
def no_weights(monkeypatch):
    """Fail the test if any model's weights are loaded."""
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("model weights loaded"))


def logged(run_dir: Path, key: str) -> list[float]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


def test_the_cross_tokenizer_options_compose_into_the_method(tmp_path):
    default = compose_train(tmp_path, [])
    assert OmegaConf.to_container(default.method.cross_tokenizer) == {
        "enabled": "auto",
        "loss": "projected",
        "alignment": "bytes",
        "merge": "observed",
        "beta": None,
        "student_temperature": None,
        "teacher_temperature": None,
        "skip_student_eos": False,
        "skip_teacher_eos": False,
        "matched_weight": None,
        "unmatched_weight": None,
        "matched_divergence": "clamped",
        "teacher_max_length": None,
        "projection_cache": None,
        "distillation_weight": 1.0,  # TRL's uld_distillation_weight
        "crossentropy_weight": 0.0,  # TRL's uld_crossentropy_weight
    }
    assert default.method.teacher.tokenizer is None
    assert compose_train(tmp_path, ["cross_tokenizer=uld"]).method.cross_tokenizer.loss == "uld"
    assert compose_train(tmp_path, ["cross_tokenizer=hybrid"]).method.cross_tokenizer.loss == "hybrid"
    for loss in ("likelihood", "projected"):
        assert compose_train(tmp_path, [f"cross_tokenizer={loss}"]).method.cross_tokenizer.loss == loss
    off = compose_train(tmp_path, ["cross_tokenizer=off"]).method.cross_tokenizer
    assert off.enabled == "never" and off.loss == "projected"


@pytest.mark.parametrize("where", ["folder", "teacher.tokenizer"])
def test_a_bpe_teacher_trains_through_the_cross_tokenizer_loss(tmp_path, bpe_folders, where):
    teacher = {
        "folder": [f"model.teacher.name_or_path={bpe_folders / 'teacher'}"],
        "teacher.tokenizer": [
            f"model.teacher.name_or_path={bpe_folders / 'bare'}",
            f"teacher.tokenizer={bpe_folders / 'tokenizer'}",
        ],
    }[where]
    result = run(compose_train(tmp_path, [*FAST, *teacher, "method.lmbda=0.5"]))
    assert result["global_step"] == 2
    run_dir = tmp_path / "run"
    groups = logged(run_dir, "train/cross_tokenizer/groups")
    assert len(groups) == 2 and all(g >= 4 for g in groups)
    assert len(logged(run_dir, "val/cross_tokenizer/groups")) == 1
    assert all(loss > 0 for loss in logged(run_dir, "train/loss"))


def test_the_model_specs_tokenizer_key_names_the_teachers_tokenizer(tmp_path, bpe_folders):
    overrides = [
        f"model.teacher.name_or_path={bpe_folders / 'bare'}",
        f"+model.teacher.tokenizer={bpe_folders}/tokenizer",
    ]
    module = build(compose_train(tmp_path, [*FAST, *overrides])).module
    assert isinstance(module.loss, CrossTokenizerDistillation)
    assert module.teacher.config.vocab_size == len(module.loss.teacher_tokenizer)
    assert module.loss.max_length == 64 + 6  # data.max_length + method.sampling.max_new_tokens


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.assistant_turns=all"],
            r"data\.assistant_turns=all with a teacher whose tokenizer differs from the student's: .* "
            r"Set data\.assistant_turns=last",
        ),
        (
            ["teacher=cache", "method.lmbda=0.0", "+model.teacher.tokenizer={tokenizer}"],
            r"model\.teacher's tokenizer \(.*tokenizer\) differs from the student's tokenizer, but "
            r"teacher\.kind=cache .* use teacher=local",
        ),
        (  # the teacher's own folder holds its tokenizer
            ["teacher=server"],
            r"model\.teacher's tokenizer \(.*teacher\) differs from .* teacher\.kind=server gives its signal",
        ),
        (["method.seq_kd=true"], r"seq_kd=true with a teacher whose tokenizer differs"),
        (["method=opd"], r"OPDModule cannot distil from a teacher whose tokenizer differs"),
    ],
)
def test_what_the_cross_path_cannot_do_is_refused_before_models_load(
    tmp_path, bpe_folders, no_weights, overrides, message
):
    overrides = [o.format(tokenizer=bpe_folders / "tokenizer") for o in overrides]
    cfg = compose_train(tmp_path, [*FAST, f"model.teacher.name_or_path={bpe_folders / 'teacher'}", *overrides])
    # the module's own refusals come wrapped in hydra's InstantiationException, with the message
    with pytest.raises((ValueError, InstantiationException), match=message):
        build(cfg)


def test_cross_tokenizer_off_keeps_the_usual_vocabulary_check(tmp_path, bpe_folders):
    cfg = compose_train(
        tmp_path, [*FAST, f"model.teacher.name_or_path={bpe_folders / 'teacher'}", "cross_tokenizer=off"]
    )
    with pytest.raises(
        InstantiationException,
        match=r"vocabulary size 259 differs from the teacher's \d+, and its tokenizer is another one\. .*cross_tok",
    ):
        build(cfg)


def test_model_toy_bpe_trains_two_steps(tmp_path):
    result = run(compose_train(tmp_path, [*FAST, "model=toy_bpe"]))
    assert result["global_step"] == 2
    assert len(logged(tmp_path / "run", "train/cross_tokenizer/groups")) == 2
