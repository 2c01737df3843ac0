"""PrintMetricsCallback: progress and the logged metrics as plain lines (SLURM logs; `callbacks=print_metrics`)."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import lightning as L
import torch

# Shown first, in this order; the other metrics follow sorted by name.
FIRST = ("train/loss", "train/lr", "train/tokens_per_sec", "train/on_policy_fraction", "val/loss")
# Not printed: GKD's 0/1 coin of the last batch (train/on_policy_fraction is the share so far).
HIDDEN = frozenset({"train/on_policy"})
MAX_LINES = 100  # the default cadence keeps a run to about this many train lines


class PrintMetricsCallback(L.Callback):
    """Print a line every ``every_n_steps`` optimizer steps, and the ``val/`` metrics after each validation::

        step 20/200 (10%) | 0:00:04 elapsed, 0:00:36 left | train/loss=0.2256 train/lr=0.00095 ...
        step 50/200 validation | val/accuracy=0.27 val/loss=0.1988

    ``every_n_steps=None`` follows the trainer's ``log_every_n_steps`` (when the logged metrics are fresh), times
    the smallest whole factor that keeps a run to about 100 train lines; the last step always gets a line. The
    total is ``trainer.max_steps`` (or the steps ``max_epochs`` makes); the time left extrapolates the steps of this
    fit so far. Each printed line is also kept in ``history`` as ``(step, {name: value})``.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 (or None for log_every_n_steps), got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.history: list[tuple[int, dict[str, float]]] = []
        self._last_step = -1
        self._started: tuple[float, int] | None = None  # (time, global step) when this fit's training started

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step == self._last_step:  # no step yet, or accumulating
            return
        total = total_steps(trainer)
        if step % self.cadence(trainer, total) and step != total:
            return
        self._last_step = step
        metrics = self._metrics(trainer, "train/")
        if metrics is not None:
            self.history.append((step, metrics))
            print(f"{self._progress(step, total)} | {_format(metrics)}", flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = self._metrics(trainer, "val/")
        if metrics is not None:
            step = trainer.global_step
            self.history.append((step, metrics))
            print(f"step {step}{_of(total_steps(trainer))} validation | {_format(metrics)}", flush=True)

    def cadence(self, trainer: L.Trainer, total: float) -> int:
        """Optimizer steps between two train lines."""
        if self.every_n_steps is not None:
            return self.every_n_steps
        every = max(1, int(trainer.log_every_n_steps))  # type: ignore[attr-defined]  # set at Trainer init
        if math.isfinite(total):
            every *= max(1, math.ceil(total / (MAX_LINES * every)))
        return every

    def _progress(self, step: int, total: float) -> str:
        text = f"step {step}{_of(total)}"
        if math.isfinite(total) and total > 0:
            text += f" ({100 * step / total:.0f}%)"
        if self._started is None:
            return text
        started_at, first_step = self._started
        elapsed = time.perf_counter() - started_at
        text += f" | {_clock(elapsed)} elapsed"
        if math.isfinite(total) and step > first_step:
            text += f", {_clock(elapsed / (step - first_step) * max(0.0, total - step))} left"
        return text

    @staticmethod
    def _metrics(trainer: L.Trainer, prefix: str) -> dict[str, float] | None:
        """The callback metrics under ``prefix``, on global rank zero; None elsewhere or when there are none."""
        if not trainer.is_global_zero:
            return None
        found = {
            name: _to_float(value)
            for name, value in trainer.callback_metrics.items()
            if name.startswith(prefix) and name not in HIDDEN
        }
        ordered = {name: found[name] for name in FIRST if name in found}
        ordered.update((name, found[name]) for name in sorted(found) if name not in ordered)
        return ordered or None


def total_steps(trainer: L.Trainer) -> float:
    """The optimizer steps this fit runs to: ``max_steps``, or what ``max_epochs`` makes (``inf`` if unknown)."""
    if trainer.max_steps > 0:
        return float(trainer.max_steps)
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # no sized train loader yet, or an unbounded one
        return math.inf


def _of(total: float) -> str:
    return f"/{int(total)}" if math.isfinite(total) else ""


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{name}={_number(value)}" for name, value in metrics.items())


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _to_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
