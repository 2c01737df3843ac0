"""The customization story through Hydra: optimizer/scheduler groups, quantization specs, callbacks, metrics,
precision, and the bundled offline DPO run (method=dpo data=toy_preference)."""

from __future__ import annotations

import copy
import csv
import importlib.util
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from helpers.hydra_compose import compose_train
from hydra.utils import instantiate
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config

from lightning_gkd import DPOModule, PreferenceDataModule
from lightning_gkd.cli.train import run
from lightning_gkd.models.loading import load_causal_lm, quantization_config_from_dict
from lightning_gkd.toy.preference import addition_preference_rows

FAST = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.val_batch_size=4",
    "print_config=false",
    "export=false",
]


def csv_column(tmp_path: Path, key: str) -> list[float]:
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


def test_dpo_config_composes_policy_reference_and_preference_data(tmp_path):
    cfg = compose_train(tmp_path, ["method=dpo"])
    assert cfg.data._target_ == "lightning_gkd.PreferenceDataModule"  # dpo picks the preference pairs
    assert cfg.method.model == cfg.method.reference == cfg.model.student
    assert compose_train(tmp_path, ["method=dpo", "data=toy"]).data._target_ == "lightning_gkd.ChatDataModule"
    hub = compose_train(tmp_path, ["method=dpo", "model=hub", "data=preference_files", "data.train_data=x.jsonl"])
    assert hub.method.reference.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_optimizer_scheduler_callbacks_and_metrics_from_config(tmp_path, capsys):
    cfg = compose_train(
        tmp_path,
        [
            *FAST,
            "method=dpo",
            "optimizer=sgd",
            "optimizer.lr=0.04",
            "scheduler=step",
            "scheduler.step_size=2",
            "callbacks=[default,print_metrics]",
            "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
            "+metrics=exact_match",
            "method.validation.max_new_tokens=6",
        ],
    )
    result = run(cfg)

    assert result["global_step"] == 4
    # LearningRateMonitor names the column after the optimizer class; StepLR halves the rate every 2 steps.
    assert csv_column(tmp_path, "lr-SGD") == pytest.approx([0.04, 0.04, 0.02, 0.02])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" (")[0] for line in printed if "train/loss=" in line] == [f"step {i}/4" for i in (1, 2, 3, 4)]
    assert any(line.startswith("step 4/4 validation | val/") and "val/rewards/accuracies=" in line for line in printed)
    assert 0.0 <= result["metrics"]["val/exact_match"] <= 1.0
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()  # the default callbacks are still there


def test_bf16_mixed_precision_run_computes_the_loss_in_float32(tmp_path):
    cfg = compose_train(
        tmp_path,
        [
            *FAST,
            "method=dpo",
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "callbacks=none",
        ],
    )
    result = run(cfg)
    assert result["global_step"] == 2
    losses = csv_column(tmp_path, "train/loss")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # float32 log-probs: policy == reference exactly
    assert all(math.isfinite(x) for x in losses + [result["metrics"]["val/loss"]])


@pytest.mark.parametrize(
    "option, role, key, expected",
    [
        ("reference_8bit", "reference", "load_in_8bit", True),
        ("reference_4bit", "reference", "bnb_4bit_compute_dtype", torch.bfloat16),
        ("teacher_8bit", "teacher", "load_in_8bit", True),
        ("teacher_4bit", "teacher", "bnb_4bit_quant_type", "nf4"),
    ],
)
def test_quantization_group_puts_a_bitsandbytes_config_on_the_frozen_model_only(tmp_path, option, role, key, expected):
    method = ["method=dpo"] if role == "reference" else []
    cfg = compose_train(tmp_path, [*method, "model=hub", f"+quantization={option}"])
    spec = instantiate(cfg.method[role], _convert_="all")
    if role == "teacher":  # method.teacher is ${teacher}: the in-process teacher's spec holds the model source
        assert spec["kind"] == "local"
        spec = spec["model"]
    source = cfg.model.student if role == "reference" else cfg.model.teacher
    assert spec["name_or_path"] == source.name_or_path and spec["trust_remote_code"] is False
    assert spec["init_kwargs"]["dtype"] == "auto"  # the model group's other init_kwargs are kept
    quantization = spec["init_kwargs"]["quantization_config"]
    assert isinstance(quantization, BitsAndBytesConfig) and getattr(quantization, key) == expected
    trainable = cfg.method["model" if role == "reference" else "student"]
    assert "quantization_config" not in trainable.init_kwargs


def test_a_plain_quantization_mapping_reaches_from_pretrained_as_a_config(monkeypatch, hub_reachable):
    calls = []
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda name, **kw: Qwen2Config())  # a text model's config
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda name, **kw: calls.append(kw) or torch.nn.Linear(1, 1)
    )
    load_causal_lm(
        {
            "name_or_path": "org/model",
            "init_kwargs": {"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}},
        }
    )
    config = calls[0]["quantization_config"]
    assert isinstance(config, BitsAndBytesConfig) and config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    generic = quantization_config_from_dict({"quant_method": "bitsandbytes", "load_in_8bit": True})
    assert isinstance(generic, BitsAndBytesConfig) and generic.load_in_8bit


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes quantization needs a CUDA GPU and the bitsandbytes package",
)
def test_an_8bit_reference_trains_a_policy_on_gpu(student, tokenizer, tmp_path):
    student.save_pretrained(tmp_path / "policy")
    module = DPOModule(
        str(tmp_path / "policy"),
        tokenizer,
        reference={
            "name_or_path": str(tmp_path / "policy"),
            "init_kwargs": {"quantization_config": {"load_in_8bit": True}},
        },
    )
    assert module.reference.is_loaded_in_8bit
    data = PreferenceDataModule(tokenizer, addition_preference_rows("train", 16), batch_size=4, max_length=64)
    trainer = small_trainer(tmp_path, accelerator="gpu", max_steps=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and math.isfinite(float(trainer.callback_metrics["train/loss"]))


@pytest.mark.slow
def test_offline_dpo_run_prefers_correct_sums_on_held_out_pairs(tmp_path):
    # The bundled run as shipped, minus checkpoints and export.
    cfg = compose_train(
        tmp_path, ["method=dpo", "data=toy_preference", "callbacks=none", "export=false", "print_config=false"]
    )
    result = run(cfg)
    accuracies = csv_column(tmp_path, "val/rewards/accuracies")
    assert result["global_step"] == cfg.trainer.max_steps and accuracies
    assert accuracies[-1] > 0.6, accuracies  # the held-out pairs; chance is 0.5
    assert result["metrics"]["val/rewards/margins"] > 0 and result["metrics"]["val/loss"] < math.log(2)


class GradientCapture(L.Callback):
    """The accumulated gradients Lightning hands to the optimizer, per optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()})


def accumulated_gradient(
    tmp_path, policy, reference, tokenizer, rows, batch_size: int, accumulate: int
) -> dict[str, torch.Tensor]:
    module = DPOModule(copy.deepcopy(policy), tokenizer, reference=copy.deepcopy(reference))
    capture = GradientCapture()
    data = PreferenceDataModule(tokenizer, rows, batch_size=batch_size, shuffle=False, max_length=64)
    small_trainer(tmp_path, max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture]).fit(
        module, datamodule=data
    )
    assert len(capture.steps) == 1
    return capture.steps[0]


def test_gradient_accumulation_equals_one_large_batch_when_micro_batches_are_equal(student, tokenizer, tmp_path):
    rows = addition_preference_rows("train", 6)
    reference = copy.deepcopy(student)
    with torch.no_grad():  # policy != reference, so each pair's weight sigma(-beta * margin) differs
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    full = accumulated_gradient(tmp_path, student, reference, tokenizer, rows, batch_size=6, accumulate=1)
    three_by_two = accumulated_gradient(tmp_path, student, reference, tokenizer, rows, batch_size=2, accumulate=3)
    for name, grad in full.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(three_by_two[name], grad, atol=1e-7, rtol=1e-4)
    # The condition matters: micro-batches of 4 then 2 pairs weigh each pair of the smaller one double.
    uneven = accumulated_gradient(tmp_path, student, reference, tokenizer, rows, batch_size=4, accumulate=2)
    assert not torch.allclose(uneven["model.embed_tokens.weight"], full["model.embed_tokens.weight"], atol=1e-6)
