"""Token-level loss normalisation over the whole optimizer step.

GKD's and SFT's losses are token means. Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and
DDP/FSDP average gradients over ranks, so with per-micro-batch means a token in a short micro-batch would weigh more
than one in a long micro-batch (on-policy samples end anywhere). With ``mode="step"`` each micro-batch
backpropagates its token *sum*; once the step's gradients are complete (``on_before_optimizer_step``), the token
count of the whole step (every micro-batch of the accumulation window, every rank: one all-reduce) is known and the
gradients are scaled by ``accumulate * world_size / N``. The update is then exactly one big batch's: the gradient
of the token mean over the optimizer batch (TRL's ``num_items_in_batch``). ``mode="micro_batch"`` keeps each
micro-batch's own mean (the behaviour before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch

LossNormalization = Literal["step", "micro_batch"]


class StepTokenNormalizer:
    """``micro_batch_loss`` in ``training_step``, ``finish_step`` in ``on_before_optimizer_step`` (see the module)."""

    def __init__(self, mode: LossNormalization = "step") -> None:
        self.mode = mode  # checked by TrainingSettings
        self._sum: torch.Tensor | None = None  # the step's token-loss sum on this rank
        self._tokens: torch.Tensor | None = None

    @property
    def per_step(self) -> bool:
        return self.mode == "step"

    def micro_batch_loss(self, mean_loss: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """What to backpropagate for a micro-batch whose mean loss is ``mean_loss`` over ``num_tokens`` units
        (supervised tokens, or whatever the loss averages over: ``LossOutput.count``)."""
        if not self.per_step:
            return mean_loss
        tokens = num_tokens.to(device=mean_loss.device, dtype=torch.float32)
        total = mean_loss * tokens
        self._sum = total.detach() if self._sum is None else self._sum + total.detach()
        self._tokens = tokens if self._tokens is None else self._tokens + tokens
        return total

    def finish_step(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        accumulate: int,
        world_size: int,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor | None:
        """Scale the step's gradients to the token mean over the whole step and return that mean loss (None when
        nothing was recorded: ``mode="micro_batch"``, or every micro-batch was skipped)."""
        if self._sum is None or self._tokens is None:
            return None
        totals = reduce_sum(torch.stack([self._sum, self._tokens]).float())
        self._sum = self._tokens = None
        tokens = totals[1].clamp(min=1.0)
        factor = accumulate * world_size / tokens
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(factor.to(parameter.grad.dtype))
        return totals[0] / tokens
