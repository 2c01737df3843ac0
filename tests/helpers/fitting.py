"""Small real fits the tests share: the small CPU Trainer every test fit runs on (``small_trainer``), a GKD module on
the tiny models, and reading what a fit logged."""

from __future__ import annotations

import csv
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.losses import DistillationLoss, LossOutput
from lightning_gkd.toy import addition_rows


def with_group_defaults(kwargs: dict[str, Any], **groups: dict[str, Any]) -> dict[str, Any]:
    """A method's arguments ``kwargs`` with the ``groups``' settings (name -> {key: value}) under what the caller gave
    in each group (a mapping of overrides)."""
    return {**kwargs, **{name: {**defaults, **(kwargs.get(name) or {})} for name, defaults in groups.items()}}


class LossOf(DistillationLoss):
    """A loss object calling ``fn(student, batch) -> LossOutput`` (a test's wrapper around a module's loss)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, student: Any, batch: Any) -> LossOutput:
        return self.fn(student, batch)


def make_module(student, teacher, tokenizer, **kwargs):
    defaults = with_group_defaults(
        kwargs, sampling={"max_new_tokens": 6}, training={"optimizer": partial(torch.optim.AdamW, lr=1e-2)}
    )
    return GKDModule(student, teacher, tokenizer, **defaults)


def small_trainer(root: str | Path, *, csv: bool = False, **overrides: Any) -> L.Trainer:
    """The small CPU Trainer of the tests: one CPU device, quiet (no progress bar, no model summary), writing only
    under ``root`` (``default_root_dir``), with no logger, no checkpoints and no validation unless asked, and every
    logged step kept (``log_every_n_steps=1``). ``csv=True`` logs to ``root/metrics.csv`` (a ``CSVLogger``; read it
    with ``logged``). ``overrides`` are Trainer arguments replacing these defaults or adding to them: a test passes
    only what it needs (``max_steps``, ``limit_val_batches=1`` with ``val_check_interval``, callbacks, precision,
    ``enable_checkpointing=True``, ...)."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": CSVLogger(root, name="", version="") if csv else False,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "default_root_dir": root,
    }
    return L.Trainer(**{**settings, **overrides})


def fit(module, tokenizer, rows, tmp_path, max_steps=3, **trainer_kwargs):
    """A real fit of ``max_steps`` steps on ``rows`` ("train", "val" and, when given, "test"), batch 4, validating one
    batch at the last step, logging every step to ``tmp_path/metrics.csv``, checkpoints on (Lightning's default);
    ``trainer_kwargs`` add to or replace the Trainer's arguments."""
    datamodule = ChatDataModule(
        tokenizer, rows["train"], rows["val"], test_data=rows.get("test"), batch_size=4, max_length=64
    )
    settings = {"limit_val_batches": 1, "val_check_interval": max_steps, "enable_checkpointing": True}
    trainer = small_trainer(tmp_path, csv=True, max_steps=max_steps, **{**settings, **trainer_kwargs})
    trainer.fit(module, datamodule=datamodule)
    return trainer


def fit_one_step(module, tokenizer, tmp_path, precision, *, datamodule=None, max_steps=1, **trainer_kwargs):
    """A real Lightning fit of ``max_steps`` steps on CPU (toy addition rows unless a datamodule is given)."""
    datamodule = datamodule or ChatDataModule(tokenizer, addition_rows("train", 8), batch_size=4, max_length=64)
    trainer = small_trainer(tmp_path, max_steps=max_steps, precision=precision, **trainer_kwargs)
    trainer.fit(module, datamodule=datamodule)
    return trainer


def logged(tmp_path, key):
    with open(tmp_path / "metrics.csv") as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


def per_step(run_dir: Path, key: str) -> dict[int, float]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(handle) if row.get(key)}
