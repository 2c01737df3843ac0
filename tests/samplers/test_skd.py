"""lightning_gkd.samplers.SpeculativeKDSampler (``sampler=skd``) driving GKD and OPD through a real Trainer: at K =
vocabulary size a fit is the plain sampler's fit, the replacement rate is logged per step, grouped generation and the
CLI compose with it, and a teacher it cannot verify with is refused before any model loads. With a served teacher:
tests/samplers/test_skd_server.py."""

import csv
import math
from functools import partial

import pytest
import torch
from helpers.fitting import fit, logged, make_module, small_trainer
from helpers.hydra_compose import compose_train

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.cli.train import build, run
from lightning_gkd.ops.decoding.sampling import generate_completions
from lightning_gkd.samplers import KVCacheSampler, Sampler, SpeculativeKDSampler


def test_at_k_the_vocabulary_size_a_fit_is_the_plain_samplers_fit(student, teacher, tokenizer, toy_rows, tmp_path):
    vocab = student.config.vocab_size
    losses = {}
    for name, sampler in (
        ("hf", partial(KVCacheSampler, matmul_precision="highest")),
        ("skd", partial(SpeculativeKDSampler, accept_top_k=vocab, draft_tokens=3, matmul_precision="highest")),
    ):
        torch.manual_seed(0)
        module = make_module(
            student.__class__(student.config),
            teacher,
            tokenizer,
            lmbda=1.0,
            sampling={"sampler": sampler},
            divergence={"beta": 0.5},
        )
        module.student.load_state_dict(student.state_dict())
        fit(module, tokenizer, toy_rows, tmp_path / name, max_steps=3)
        losses[name] = logged(tmp_path / name, "train/loss")
    assert len(losses["hf"]) == 3 and losses["skd"] == pytest.approx(losses["hf"], rel=1e-6)
    assert logged(tmp_path / "skd", "train/sampler/replacement_rate") == [0.0] * 3


def test_the_teacher_corrects_the_students_samples_and_the_rate_is_logged_per_step(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    sampler = partial(SpeculativeKDSampler, accept_top_k=2, draft_tokens=4)
    module = make_module(
        student, teacher, tokenizer, lmbda=1.0, sampling={"sampler": sampler}, divergence={"beta": 1.0}
    )
    assert isinstance(module.sampler, Sampler) and module.sampler.teacher is module.teacher
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    rates = logged(tmp_path, "train/sampler/replacement_rate")
    assert len(rates) == 3 and all(0 < rate <= 1 for rate in rates)
    for key in ("teacher_tokens_per_token", "student_tokens_per_token", "tokens_per_block"):
        values = logged(tmp_path, f"train/sampler/{key}")
        assert len(values) == 3 and all(math.isfinite(v) and v > 0 for v in values), key


def test_teacher_samples_under_seq_kd_are_plain_teacher_samples(student, teacher, tokenizer):
    module = make_module(
        student,
        teacher,
        tokenizer,
        lmbda=0.0,
        seq_kd=True,
        sampling={"sampler": partial(SpeculativeKDSampler, accept_top_k=1)},
    )
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids != 0).long()
    got = module.sampler.sample(module.teacher, ids, mask, seed=3)
    want = generate_completions(
        module.teacher,
        ids,
        mask,
        max_new_tokens=6,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        temperature=module.sampling.temperature,
        seed=3,
    )
    assert torch.equal(got["input_ids"], want["input_ids"]) and module.sampler.last_stats() == {}


def test_grouped_generation_samples_a_group_once_with_the_teacher_in_the_loop(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    module = make_module(
        student, teacher, tokenizer, lmbda=1.0, sampling={"sampler": partial(SpeculativeKDSampler, accept_top_k=3)}
    )
    data = ChatDataModule(
        tokenizer, toy_rows["train"], toy_rows["val"], batch_size=2, steps_per_generation=2, max_length=64, seed=0
    )
    trainer = small_trainer(tmp_path, max_steps=4)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4 and module.sampling_calls == 2


FAST = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.test_data=null",
    "method.sampling.max_new_tokens=6",
    "method.lmbda=1.0",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
]


@pytest.mark.parametrize("method", ["gkd", "opd"])
def test_sampler_skd_composes_from_hydra_and_trains(tmp_path, method):
    overrides = [*FAST, f"method={method}", "sampler=skd", "sampler.accept_top_k=5", "sampler.draft_tokens=2"]
    if method == "opd":
        overrides.remove("method.lmbda=1.0")
    cfg = compose_train(tmp_path, overrides)
    result = run(cfg)
    assert result["global_step"] == 2
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    rates = [float(r["train/sampler/replacement_rate"]) for r in rows if r.get("train/sampler/replacement_rate")]
    assert len(rates) == 2 and all(0 <= rate <= 1 for rate in rates)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["teacher=server_hidden"], r"sampler=skd verifies .* teacher: server \(signal=hidden\)"),
        (["sampler.accept_top_k=0"], r"accept_top_k must be an integer >= 1 .*got 0"),
        (["sampler.draft_tokens=0"], r"draft_tokens must be an integer >= 1 .*got 0"),
    ],
)
def test_sampler_skd_refuses_what_it_cannot_do_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    import lightning_gkd.methods.base as base

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(base, "load_causal_lm", no_loading, raising=False)
    cfg = compose_train(tmp_path, [*FAST, "sampler=skd", *overrides])
    with pytest.raises(Exception, match=message):
        build(cfg)


def test_a_python_api_user_gets_the_same_refusal(student, tokenizer):
    with pytest.raises(ValueError, match="sampler=skd verifies"):
        GKDModule(
            student,
            {"kind": "server", "signal": "hidden", "url": "http://127.0.0.1:9", "model": "m"},
            tokenizer,
            lmbda=1.0,
            sampling={"sampler": partial(SpeculativeKDSampler, accept_top_k=5)},
        )
