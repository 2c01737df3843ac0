"""Learning-rate schedules whose warmup is given in steps or as a fraction of the run (TRL's ``warmup_ratio``)."""

from __future__ import annotations

import math

import torch

#: transformers' schedule names that take a warmup (``transformers.get_scheduler``).
WARMUP_SCHEDULES = ("cosine", "linear", "constant_with_warmup", "cosine_with_restarts", "polynomial")


class WarmupSchedule:
    """A scheduler factory (``optimizer -> LRScheduler``, what the methods' ``scheduler`` takes): transformers'
    schedule ``name`` with ``num_warmup_steps`` warmup steps, or ``ceil(warmup_ratio * num_training_steps)`` of them.

    The settings are checked when the factory is built (Hydra builds it before any model loads): a ratio outside
    [0, 1), a negative step count, both or neither warmup form, or no known run length.
    """

    def __init__(
        self,
        num_training_steps: int,
        *,
        name: str = "cosine",
        num_warmup_steps: int | None = None,
        warmup_ratio: float | None = None,
    ) -> None:
        if name not in WARMUP_SCHEDULES:
            raise ValueError(f"scheduler name must be one of {WARMUP_SCHEDULES}, got {name!r}.")
        if (num_warmup_steps is None) == (warmup_ratio is None):
            raise ValueError(
                "Give the warmup as num_warmup_steps or as warmup_ratio (a fraction of the training steps), not "
                f"{'both' if num_warmup_steps is not None else 'neither'} (got num_warmup_steps={num_warmup_steps}, "
                f"warmup_ratio={warmup_ratio}). Hydra: scheduler.num_warmup_steps=null scheduler.warmup_ratio=0.05."
            )
        if num_training_steps is None or num_training_steps < 1:
            raise ValueError(
                f"The schedule needs the run's length in optimizer steps, got num_training_steps={num_training_steps} "
                "(Hydra: it follows trainer.max_steps; set trainer.max_steps to a positive number)."
            )
        if warmup_ratio is not None and not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}.")
        if num_warmup_steps is not None and num_warmup_steps < 0:
            raise ValueError(f"num_warmup_steps must be >= 0, got {num_warmup_steps}.")
        self.name = name
        self.num_training_steps = int(num_training_steps)
        self.num_warmup_steps = num_warmup_steps
        self.warmup_ratio = warmup_ratio

    @property
    def warmup_steps(self) -> int:
        """The warmup in optimizer steps."""
        if self.num_warmup_steps is not None:
            return int(self.num_warmup_steps)
        return math.ceil(float(self.warmup_ratio or 0.0) * self.num_training_steps)

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        from transformers import get_scheduler

        return get_scheduler(
            self.name,
            optimizer,
            num_warmup_steps=self.warmup_steps,
            num_training_steps=self.num_training_steps,
        )

    def __repr__(self) -> str:
        warmup = (
            f"num_warmup_steps={self.num_warmup_steps}"
            if self.warmup_ratio is None
            else f"warmup_ratio={self.warmup_ratio}"
        )
        return f"WarmupSchedule({self.name!r}, num_training_steps={self.num_training_steps}, {warmup})"
