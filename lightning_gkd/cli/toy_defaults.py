"""Warn when values tuned for the shipped toy models meet a real model (``lightning-gkd model=hub ...`` without a
real-use preset): a learning rate of 1e-3, 8-token samples, exact-match validation on free-form chat, a fixed warmup."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

#: Above this learning rate a real model's weights are being hit with a toy-sized step.
TOY_LR = 1e-4
#: At most this many new tokens is a toy budget (the toy answers are 3-8 tokens).
TOY_NEW_TOKENS = 16


def is_toy_model(spec: Any, cache_dir: str | None) -> bool:
    """Whether a model spec is one of the project's own small models: a shipped asset (``lightning_gkd/assets``), one
    built under ``paths.cache_dir`` (``model=tiny``), or a fresh model from a ``config``."""
    from lightning_gkd.toy.tiny import asset_path

    if not isinstance(spec, Mapping):
        return False
    if spec.get("config") is not None:
        return True
    name = spec.get("name_or_path")
    if not name:
        return False
    path = Path(str(name)).expanduser().resolve()
    roots = [Path(asset_path(".")).resolve()] + ([Path(cache_dir).expanduser().resolve()] if cache_dir else [])
    return any(path == root or root in path.parents for root in roots)


def _is_toy_data(data: Mapping[str, Any]) -> bool:
    train = data.get("train_data")
    return isinstance(train, Mapping) and str(train.get("_target_", "")).startswith("lightning_gkd.toy")


def _samples_during_training(method: Mapping[str, Any]) -> bool:
    if "max_new_tokens" not in (method.get("sampling") or {}):
        return False
    if str(method.get("_target_", "")).endswith("OPDModule"):
        return True
    return float(method.get("lmbda") or 0.0) > 0 or bool(method.get("seq_kd"))


def toy_defaults_for_real_model(cfg: DictConfig) -> list[str]:
    """The toy-tuned values in ``cfg`` that would hurt a real student, one line each (empty for a toy student)."""
    container: dict[str, Any] = {
        key: OmegaConf.to_container(cfg[key], resolve=True, throw_on_missing=False)
        for key in ("model", "method", "optimizer", "scheduler", "trainer", "data", "paths")
        if isinstance(cfg.get(key), DictConfig)
    }
    model, method = container.get("model") or {}, container.get("method") or {}
    student = model.get("student")
    if is_toy_model(student, (container.get("paths") or {}).get("cache_dir")):
        return []
    found: list[str] = []
    lr = (container.get("optimizer") or {}).get("lr")
    if isinstance(lr, (int, float)) and lr >= TOY_LR:
        found.append(
            f"optimizer.lr={lr:g} is the toy models' rate; real models train at about 1e-6 to 2e-5 "
            "(a step this large can wreck a pretrained model in a few updates)."
        )
    budget = (method.get("sampling") or {}).get("max_new_tokens")
    if isinstance(budget, int) and budget <= TOY_NEW_TOKENS and _samples_during_training(method):
        found.append(
            f"method.sampling.max_new_tokens={budget}: every on-policy or teacher sample is cut after {budget} tokens "
            "(real answers need 128-512)."
        )
    validation = method.get("validation") or {}
    eval_budget = validation.get("max_new_tokens")
    if isinstance(eval_budget, int) and eval_budget <= TOY_NEW_TOKENS:
        found.append(
            f"method.validation.max_new_tokens={eval_budget}: validation completions, the sample table and the "
            f"held-out evaluation stop after {eval_budget} tokens."
        )
    metrics = validation.get("metrics") or {}
    data = container.get("data") or {}
    exact = [name for name, entry in metrics.items() if "exact_match" in str((entry or {}).get("_target_", ""))]
    if exact and not _is_toy_data(data):
        found.append(
            f"method.validation.metrics.{exact[0]} is exact match against the dataset completion: on free-form chat "
            "it stays near 0 and costs a generation pass per validation; method.validation.metrics=null validates on "
            "the loss alone."
        )
    scheduler = container.get("scheduler") or {}
    steps, max_steps = scheduler.get("num_warmup_steps"), (container.get("trainer") or {}).get("max_steps")
    if isinstance(steps, int) and isinstance(max_steps, int) and max_steps > 0 and steps > 0:
        share = steps / max_steps
        if share < 0.01 or share > 0.5:
            found.append(
                f"scheduler.num_warmup_steps={steps} is {share:.1%} of trainer.max_steps={max_steps}; a warmup that "
                "scales with the run: scheduler.num_warmup_steps=null scheduler.warmup_ratio=0.05."
            )
    trainer = container.get("trainer") or {}
    if trainer.get("accelerator") == "cpu" and str(trainer.get("precision")) == "32-true":
        found.append(
            "trainer=cpu in float32: a real model trains very slowly on a CPU; on a GPU use trainer=gpu (bf16-mixed)."
        )
    return found


def warn_toy_defaults(cfg: DictConfig) -> list[str]:
    """Warn once (rank zero) listing ``toy_defaults_for_real_model``; returns the lines."""
    found = toy_defaults_for_real_model(cfg)
    if found:
        student = (cfg.model.get("student") or {}).get("name_or_path")
        rank_zero_warn(
            f"The student ({student}) is not one of the toy models, but these values are tuned for the toy task:\n"
            + "\n".join(f"  - {line}" for line in found)
            + "\nexperiment=hub_gpu (GKD/OPD), hub_gpu_sft or hub_gpu_dpo set real-use values (README, 'Real models')."
        )
    return found
