"""Trainer precision: a frozen model whose dtype was not chosen follows it (bf16 under bf16-*; under 32-true bf16
where the hardware multiplies bf16 fast, else float32); a chosen dtype and the trained model's float32 weights stay;
``frozen_dtype`` forces the frozen models' dtype; every trainer config composes with its precision."""

from functools import partial

import pytest
import torch
from helpers.fitting import fit_one_step
from helpers.hydra_compose import compose_train

from lightning_gkd import ChatDataModule, DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.models import precision as precision_module
from lightning_gkd.toy import addition_preference_rows, addition_rows


@pytest.fixture()
def teacher_dir(teacher, tmp_path):
    teacher.save_pretrained(tmp_path / "teacher")
    return str(tmp_path / "teacher")


@pytest.mark.parametrize(
    "teacher_spec, precision, expected",
    [
        ("path", "bf16-mixed", torch.bfloat16),
        ({"init_kwargs": {"dtype": "auto"}}, "bf16-mixed", torch.bfloat16),
        ({"init_kwargs": {"dtype": "float32"}}, "bf16-mixed", torch.float32),  # chosen: kept
        ("path", "32-true", "fast"),
    ],
)
def test_teacher_dtype_follows_precision_unless_chosen(
    student, tokenizer, teacher_dir, tmp_path, teacher_spec, precision, expected
):
    if expected == "fast":  # 32-true: bfloat16 on hardware with fast bf16 matmuls (this CPU's flags decide)
        expected = torch.bfloat16 if precision_module.bf16_matmul_is_fast("cpu") else torch.float32
    source = teacher_dir if teacher_spec == "path" else {"name_or_path": teacher_dir, **teacher_spec}
    module = GKDModule(
        student, source, tokenizer, lmbda=0.0, training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)}
    )
    before = {n: p.detach().clone() for n, p in module.student.named_parameters()}
    fit_one_step(module, tokenizer, tmp_path, precision)
    assert {p.dtype for p in module.teacher.parameters()} == {expected}
    # the trained weights stay float32 (mixed precision keeps master weights) and were updated
    assert {p.dtype for p in module.student.parameters()} == {torch.float32}
    assert any(not torch.equal(before[n], p) for n, p in module.student.named_parameters())


@pytest.mark.parametrize("fast", [True, False])
def test_frozen_models_take_bf16_under_32_true_only_where_bf16_is_fast(
    student, tokenizer, teacher_dir, tmp_path, monkeypatch, fast
):
    monkeypatch.setattr(precision_module, "bf16_matmul_is_fast", lambda device: fast)
    module = GKDModule(
        student, teacher_dir, tokenizer, lmbda=0.0, training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)}
    )
    fit_one_step(module, tokenizer, tmp_path, "32-true")
    assert {p.dtype for p in module.teacher.parameters()} == {torch.bfloat16 if fast else torch.float32}
    assert {p.dtype for p in module.student.parameters()} == {torch.float32}


@pytest.mark.parametrize("frozen_dtype", ["float32", "bfloat16"])
def test_frozen_dtype_forces_every_frozen_model(student, teacher, tokenizer, tmp_path, frozen_dtype):
    # a named frozen_dtype casts an nn.Module teacher in any dtype
    module = GKDModule(
        student, teacher.to(torch.float16), tokenizer, lmbda=0.0, training={"frozen_dtype": frozen_dtype}
    )
    fit_one_step(module, tokenizer, tmp_path, "32-true")
    assert {p.dtype for p in module.teacher.parameters()} == {getattr(torch, frozen_dtype)}


@pytest.mark.parametrize("fast", [True, False])
def test_auto_treats_a_float32_module_teacher_like_one_loaded_from_a_folder(
    student, teacher, tokenizer, teacher_dir, tmp_path, monkeypatch, caplog, fast
):
    """The Python API (an nn.Module teacher) runs the teacher in the dtype the CLI (a folder) gives it, and says so
    once; a module in another dtype than float32 keeps it (its dtype was chosen)."""
    monkeypatch.setattr(precision_module, "bf16_matmul_is_fast", lambda device: fast)
    expected = torch.bfloat16 if fast else torch.float32
    from_folder = GKDModule(student, teacher_dir, tokenizer, lmbda=0.0)
    fit_one_step(from_folder, tokenizer, tmp_path, "32-true")
    caplog.clear()
    with caplog.at_level("INFO"):
        from_module = GKDModule(student, teacher.to(torch.float32), tokenizer, lmbda=0.0)
        trainer = fit_one_step(from_module, tokenizer, tmp_path, "32-true")
        trainer.validate(from_module, ChatDataModule(tokenizer, addition_rows("val", 4), batch_size=4, max_length=64))
    assert {p.dtype for p in from_module.teacher.parameters()} == {expected}
    assert {p.dtype for p in from_folder.teacher.parameters()} == {expected}
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("The teacher runs in")]
    if fast:
        assert said == [
            "The teacher runs in bfloat16 (its weights were float32; it is never trained): frozen_dtype='auto' under "
            "precision '32-true' on cpu. frozen_dtype='float32' keeps it float32."
        ]
    else:
        assert said == []  # nothing changed, nothing to say
    chosen = GKDModule(student, teacher.to(torch.float16), tokenizer, lmbda=0.0)
    fit_one_step(chosen, tokenizer, tmp_path, "32-true")
    assert {p.dtype for p in chosen.teacher.parameters()} == {torch.float16}


def test_dpo_reference_in_bf16_trains_the_float32_policy(student, tokenizer, teacher_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(precision_module, "bf16_matmul_is_fast", lambda device: True)
    student.save_pretrained(tmp_path / "policy")
    module = DPOModule(str(tmp_path / "policy"), tokenizer, reference=str(tmp_path / "policy"))
    data = PreferenceDataModule(tokenizer, addition_preference_rows("train", 8), batch_size=4, max_length=64)
    trainer = fit_one_step(module, tokenizer, tmp_path, "32-true", datamodule=data, max_steps=2)
    assert {p.dtype for p in module.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_bf16_true_runs_everything_in_bf16(student, tokenizer, teacher_dir, tmp_path):
    module = GKDModule(
        student,
        teacher_dir,
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 4},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)},
    )
    fit_one_step(module, tokenizer, tmp_path, "bf16-true")
    assert {p.dtype for p in module.teacher.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.student.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "trainer_group, accelerator, precision, strategy",
    [
        ("cpu", "cpu", "32-true", "auto"),
        ("gpu", "gpu", "bf16-mixed", "auto"),
        ("ddp", "auto", "32-true", "ddp"),
        ("fsdp", "gpu", "32-true", "ModelParallelStrategy"),
    ],
)
def test_trainer_groups_compose(tmp_path, trainer_group, accelerator, precision, strategy):
    cfg = compose_train(tmp_path, [f"trainer={trainer_group}", "trainer.precision=bf16-true"])
    assert cfg.trainer.precision == "bf16-true"  # overridable everywhere
    cfg = compose_train(tmp_path, [f"trainer={trainer_group}"])
    assert cfg.trainer.accelerator == accelerator and cfg.trainer.precision == precision
    got = cfg.trainer.strategy if isinstance(cfg.trainer.strategy, str) else cfg.trainer.strategy._target_
    assert got.endswith(strategy)
    assert cfg.trainer.max_steps == 200 and cfg.trainer.gradient_clip_val == 1.0  # shared values from default
