"""A plain Lightning Trainer for the benchmarks and scripts that fit a module in Python: one device, clipping 1.0, no
validation, logger, checkpoints, progress bar or summary; and a callback recording when each optimizer step ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L


class StepEnds(L.Callback):
    """``ends``: the ``time.perf_counter()`` at each optimizer step's end, after ``synchronize`` (e.g. CUDA's) when
    given, so a step's time is its device work too."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.ends: list[float] = []
        self.synchronize = synchronize

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.synchronize is not None:
            self.synchronize()
        self.ends.append(time.perf_counter())


def plain_trainer(
    max_steps: int,
    *,
    accelerator: str = "cpu",
    precision: str = "32-true",
    callbacks: Sequence[L.Callback] = (),
    **options: Any,
) -> L.Trainer:
    """A Trainer of ``max_steps`` optimizer steps on one ``accelerator`` device at ``precision``, clipping gradients at
    norm 1.0, without validation, logger, checkpoints, progress bar or model summary; ``options``: more Trainer
    arguments, or other values of these (``strategy``, ``default_root_dir``, ``limit_val_batches=1.0`` with a
    ``val_check_interval`` to validate)."""
    settings: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": 1,
        "precision": precision,
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "gradient_clip_val": 1.0,
        "callbacks": list(callbacks),
    }
    return L.Trainer(**{**settings, **options})
