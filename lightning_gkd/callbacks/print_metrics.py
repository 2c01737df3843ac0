"""PrintMetricsCallback: the logged metrics on the console (Hydra: `callbacks=[default,print_metrics]`)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class PrintMetricsCallback(L.Callback):
    """Print the optimizer step and the logged metrics: the ``train/`` ones every ``every_n_steps`` optimizer steps
    (default: the trainer's ``log_every_n_steps``) and the ``val/`` ones after each validation.

    Each printed line is also kept in ``history`` as ``(step, {name: value})``.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 (or None for log_every_n_steps), got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.history: list[tuple[int, dict[str, float]]] = []
        self._last_step = -1

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]  # set at Trainer init
        if step == 0 or step == self._last_step or step % every:  # no step yet, accumulating, or off-cadence
            return
        self._last_step = step
        self._emit(trainer, step, "train/")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._emit(trainer, trainer.global_step, "val/")

    def _emit(self, trainer: L.Trainer, step: int, prefix: str) -> None:
        metrics = {
            name: _to_float(value)
            for name, value in sorted(trainer.callback_metrics.items())
            if name.startswith(prefix)
        }
        if not metrics or not trainer.is_global_zero:
            return
        self.history.append((step, metrics))
        print(f"step {step}: " + "  ".join(f"{name}={value:.4g}" for name, value in metrics.items()), flush=True)


def _to_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
