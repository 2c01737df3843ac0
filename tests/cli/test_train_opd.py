"""`lightning-gkd method=opd`: the OPD config composes with the default toy setup and trains offline, writing the
OPD metrics; the stabilisers for γ > 0 (length_normalize, baseline, clip_ratio) are command-line overrides that
reach the loss, and invalid values of them, like a teacher cache, are refused before any model loads."""

import csv
import math

import pytest
from helpers.hydra_compose import compose_train
from helpers.opd_metrics import OPD_METRICS
from transformers import AutoModelForCausalLM

from lightning_gkd.cli.train import build, run

FAST = [
    "method=opd",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.test_data=null",
    "method.sampling.max_new_tokens=6",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_method_opd_composes_and_trains_with_grouped_generation(tmp_path):
    cfg = compose_train(
        tmp_path,
        [
            *FAST,
            "data.steps_per_generation=3",
            "method.policy_gradient.gamma=0.5",
            "method.policy_gradient.kl_coef=0.1",
        ],
    )
    assert cfg.method._target_ == "lightning_gkd.OPDModule" and cfg.method.teacher.kind == "local"
    assert cfg.method.sampling.temperature == 1.0 and cfg.method.divergence.beta == 1.0 and "lmbda" not in cfg.method
    # the stabilisers are off by default: today's surrogate
    assert (
        cfg.method.policy_gradient.length_normalize is False
        and cfg.method.policy_gradient.baseline == "none"
        and cfg.method.policy_gradient.clip_ratio is None
    )
    result = run(cfg)
    assert result["global_step"] == 3
    assert math.isfinite(result["metrics"]["val/loss"]) and result["metrics"]["train/on_policy"] == 1.0
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    for key in [*OPD_METRICS, "train/opd/divergence", "train/loss", "train/completion_length"]:
        values = [float(r[key]) for r in rows if r.get(key)]
        assert len(values) == 3 and all(math.isfinite(v) for v in values), key
    weights = [float(r["train/opd/is_weight_mean"]) for r in rows if r.get("train/opd/is_weight_mean")]
    # the first micro-batch of the group was sampled by the weights it trains (the hf sampler's matmul_precision is
    # "medium": bf16 products where the CPU has them, so 1 up to that rounding)
    assert weights[0] == pytest.approx(1.0, abs=0.02)
    student = AutoModelForCausalLM.from_pretrained(result["student_dir"])
    assert student.config.hidden_size == 64


def test_method_opd_stabilisers_are_overrides_that_reach_the_loss_and_train(tmp_path):
    stabilisers = [
        "method.policy_gradient.length_normalize=true",
        "method.policy_gradient.baseline=row",
        "method.policy_gradient.clip_ratio=0.2",
    ]
    cfg = compose_train(
        tmp_path, [*FAST, "data.steps_per_generation=2", "method.policy_gradient.gamma=1.0", *stabilisers]
    )
    built = build(cfg)
    settings = built.module.loss.policy_gradient
    assert (settings.gamma, settings.length_normalize, settings.baseline, settings.clip_ratio) == (
        1.0,
        True,
        "row",
        0.2,
    )
    recorded = built.module.hparams.policy_gradient
    assert recorded["baseline"] == "row" and recorded["clip_ratio"] == 0.2  # in the checkpoint
    result = run(cfg)
    assert result["global_step"] == 3
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    clipped = [float(r["train/opd/clipped_fraction"]) for r in rows if r.get("train/opd/clipped_fraction")]
    centred = [float(r["train/opd/advantage_mean"]) for r in rows if r.get("train/opd/advantage_mean")]
    assert len(clipped) == 3 and all(0.0 <= value <= 1.0 for value in clipped)
    # a group's first micro-batch was sampled by the weights it trains: ratio 1 up to the sampler's rounding
    assert clipped[0] == 0.0 and clipped[2] == 0.0
    assert len(centred) == 3 and all(abs(value) < 1e-5 for value in centred)  # baseline=row centres every row


@pytest.mark.parametrize(
    "override, match",
    [
        ("method.policy_gradient.baseline=mean", r"baseline must be 'none' .* or 'row'"),
        ("method.policy_gradient.clip_ratio=1.5", r"clip_ratio .* must be in \(0, 1\)"),
        ("method.policy_gradient.length_normalize=maybe", r"length_normalize must be true or false, got 'maybe'"),
    ],
)
def test_method_opd_refuses_invalid_stabilisers_before_any_model_loads(tmp_path, override, match):
    cfg = compose_train(tmp_path, [*FAST, override])
    with pytest.raises(Exception, match=match):
        build(cfg)
    assert not (tmp_path / "run" / "logs").exists()


def test_method_opd_refuses_a_teacher_cache_before_any_model_loads(tmp_path):
    cfg = compose_train(tmp_path, [*FAST, "teacher=cache", "teacher.path=/nonexistent/cache"])
    with pytest.raises(Exception, match=r"teacher\.kind=cache.*cannot|teacher\.kind=cache.*teacher=server"):
        build(cfg)
    assert not (tmp_path / "run" / "logs").exists()


def test_experiment_toy_chain_trains_opd_on_the_chain_task_scored_by_its_final_sum(tmp_path):
    keep = ("data.test_data", "method.sampling.max_new_tokens", "trainer.max_steps", "trainer.val_check_interval")
    overrides = [o for o in FAST if not o.startswith(keep)]
    cfg = compose_train(
        tmp_path, ["experiment=toy_chain", *overrides, "trainer.max_steps=2", "trainer.val_check_interval=2"]
    )
    assert cfg.data.train_data._target_ == "lightning_gkd.toy.chain_rows"
    assert cfg.model.student.name_or_path.endswith("toy_chain/student_init")
    assert cfg.method.sampling.max_new_tokens == 40 and cfg.method.validation.metrics.accuracy._target_.endswith(
        "final_answer_match"
    )
    result = run(cfg)
    assert result["global_step"] == 2 and 0.0 <= result["metrics"]["val/accuracy"] <= 1.0
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        lengths = [
            float(r["train/completion_length"]) for r in csv.DictReader(handle) if r.get("train/completion_length")
        ]
    assert lengths and max(lengths) > 6  # the chain task's answers, not the addition task's 8-token budget


@pytest.mark.parametrize(
    "overrides, lr",
    [
        (["method=opd"], 1e-4),  # OPD's own learning rate (1e-3 collapses it)
        (["method=opd", "optimizer.lr=3e-4"], 3e-4),  # the user's wins
        (["method=opd", "experiment=toy_tools"], 1e-4),
        (["method=gkd"], 1e-3),  # the optimizer's default for the others
        (["method=sft"], 1e-3),
    ],
)
def test_method_opd_brings_the_learning_rate_it_needs_unless_one_is_given(tmp_path, overrides, lr):
    assert compose_train(tmp_path, overrides).optimizer.lr == pytest.approx(lr)
