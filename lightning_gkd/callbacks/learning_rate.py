"""LearningRateLogger: Lightning's LearningRateMonitor, logging ``train/lr`` and harmless without a logger."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from torch.optim import Optimizer


class LearningRateLogger(LearningRateMonitor):
    """The learning rate of each optimizer step, logged as ``train/lr`` (``train/lr/<group>`` for an optimizer with
    several parameter groups, ``train/lr-<n>`` for a second optimizer of the same class; a scheduler given a
    ``name`` in ``configure_optimizers`` keeps it).

    Unlike ``LearningRateMonitor``, a trainer without a logger is no error: the rate still reaches
    ``trainer.callback_metrics`` (the printed lines show it) at the trainer's ``log_every_n_steps``.
    """

    def __init__(self, logging_interval: str | None = "step", **kwargs: Any) -> None:
        super().__init__(logging_interval=logging_interval, **kwargs)  # type: ignore[arg-type]

    def on_train_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.loggers:
            super().on_train_start(trainer, *args, **kwargs)
        # Without a logger the names are made on first use (LearningRateMonitor._remap_keys).

    def _find_names_from_schedulers(self, lr_scheduler_configs: list) -> tuple[list[list[str]], list, defaultdict]:
        names, optimizers, types = super()._find_names_from_schedulers(lr_scheduler_configs)
        return _renamed(names, optimizers), optimizers, types

    def _find_names_from_optimizers(
        self, optimizers: list[Any], seen_optimizers: list[Optimizer], seen_optimizer_types: defaultdict
    ) -> tuple[list[list[str]], list[Optimizer]]:
        names, unseen = super()._find_names_from_optimizers(optimizers, seen_optimizers, seen_optimizer_types)
        return _renamed(names, unseen), unseen


def _renamed(names: list[list[str]], optimizers: list[Any]) -> list[list[str]]:
    """Each optimizer's names (one per parameter group) renamed by ``_ours``."""
    return [[_ours(name, type(opt)) for name in group] for group, opt in zip(names, optimizers, strict=True)]


def _ours(name: str, optimizer_class: type) -> str:
    """Lightning's ``lr-AdamW[-1][/pg]`` as ``train/lr[-1][/pg]``; a scheduler's own name stays as it is."""
    default = f"lr-{optimizer_class.__name__}"
    return "train/lr" + name[len(default) :] if name.startswith(default) else name
