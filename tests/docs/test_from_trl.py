"""docs/from_trl.md stays honest: every "supported" row names a test that exists, and the TRL arguments it
promises to cover are all there."""

import re

from helpers.paths import ROOT

from lightning_gkd import GKDModule
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm

TRL_ARGUMENTS = [
    "model",
    "teacher_model",
    "lmbda",
    "beta",
    "temperature",
    "max_new_tokens",
    "seq_kd",
    "disable_dropout",
    "teacher_model_name_or_path",
    "teacher_model_init_kwargs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "bf16",
    "gradient_checkpointing",
    "eval_strategy",
    "eval_steps",
    "save_steps",
    "logging_steps",
    "seed",
    "max_length",
    "peft_config",
    "callbacks",
    "compute_metrics",
    "optimizers",
    "data_collator",
    "formatting_func",
    "resume_from_checkpoint",
    "push_to_hub",
    "hub_model_id",
]

# DPOConfig / DPOTrainer arguments that change what DPO trains (TRL 1.16).
TRL_DPO_ARGUMENTS = [
    "ref_model",
    "loss_type",
    "label_smoothing",
    "truncation_mode",
    "precompute_ref_log_probs",
    "f_divergence_type",
    "ld_alpha",
    "use_weighting",
    "loss_weights",
    "sync_ref_model",
]


# GOLDConfig arguments of the cross-tokenizer losses (TRL 1.16, trl.experimental.gold).
TRL_GOLD_ARGUMENTS = [
    "teacher_tokenizer_name_or_path",
    "use_uld_loss",
    "uld_use_hybrid_loss",
    "use_extended_uld",
    "uld_token_merge_strategy",
    "uld_student_temperature",
    "uld_teacher_temperature",
    "uld_skip_student_eos",
    "uld_skip_teacher_eos",
    "uld_hybrid_matched_weight",
    "uld_hybrid_unmatched_weight",
    "uld_distillation_weight",
    "uld_crossentropy_weight",
]


def rows() -> list[list[str]]:
    lines = (ROOT / "docs" / "from_trl.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("| `")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]


def test_every_trl_argument_has_a_row():
    first_cells = " ".join(row[0] for row in rows())
    missing = [name for name in TRL_ARGUMENTS if f"`{name}`" not in first_cells]
    assert missing == []


def test_every_trl_dpo_argument_has_a_row():
    first_cells = " ".join(row[0] for row in rows())
    assert [name for name in TRL_DPO_ARGUMENTS if f"`{name}`" not in first_cells] == []


def test_every_trl_gold_argument_has_a_row():
    from trl.experimental.gold import GOLDConfig

    first_cells = " ".join(row[0] for row in rows())
    assert [name for name in TRL_GOLD_ARGUMENTS if f"`{name}`" not in first_cells] == []
    assert set(TRL_GOLD_ARGUMENTS) <= set(GOLDConfig.__dataclass_fields__)  # names TRL really has


def test_supported_rows_name_tests_that_exist():
    for row in rows():
        trl, status, test = row[0], row[3], row[4]
        if not status.startswith("supported"):
            continue
        named = re.findall(r"`(tests/(?:\w+/)*test_\w+\.py)(?:::(test_\w+))?", test)
        assert named, f"{trl}: 'supported' without a test (`tests/<room>/test_<module>.py::test_name`)"
        for file, function in named:
            source = (ROOT / file).read_text()
            assert not function or f"def {function}(" in source, f"{trl}: {file}::{function} does not exist"


def test_disable_dropout_zeroes_the_students_dropout(teacher, tokenizer):
    for flag, expected in ((True, 0.0), (False, 0.1)):
        student = tiny_causal_lm({**TINY_STUDENT, "attention_dropout": 0.1}, tokenizer, seed=0)
        module = GKDModule(student, teacher, tokenizer, training={"disable_dropout": flag})
        rates = {m.attention_dropout for m in module.student.modules() if hasattr(m, "attention_dropout")}
        assert rates == {expected}
