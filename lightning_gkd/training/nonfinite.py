"""The non-finite loss guard: which model produced non-finite logits, and whether to stop or skip the batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

NonFinitePolicy = Literal["raise", "skip"]
#: With nonfinite="skip", this many non-finite batches in a row stop the run: the model is broken, not unlucky.
MAX_CONSECUTIVE_SKIPS = 16


class NonFiniteGuard:
    """Checks each training loss before anything is updated with it.

    ``watch(models)`` registers a forward hook per model that records whether its logits were finite (one fused
    reduction and no host sync per forward); paths that never materialise logits report what they computed instead
    (final hidden states: ``record``, or a loss's ``LossOutput.finite`` flags: ``record_flag``).
    ``check(loss, step)`` reads those records only when the loss is non-finite: with ``policy="raise"`` it raises
    ``RuntimeError`` naming the step and the model(s) at fault; with ``"skip"`` it warns and returns True (skip the
    batch), up to ``MAX_CONSECUTIVE_SKIPS`` in a row.
    """

    def __init__(self, policy: NonFinitePolicy = "raise") -> None:
        self.policy = policy  # checked by TrainingSettings
        self.finite: dict[str, torch.Tensor] = {}  # role -> 0-dim bool of its latest forward
        self._handles: list[Any] = []
        self._skipped_in_a_row = 0

    def check_world_size(self, world_size: int) -> None:
        if self.policy == "skip" and world_size > 1:
            raise ValueError(
                "nonfinite='skip' works in a single process only (a batch skipped on one rank would "
                f"leave the other {world_size - 1} waiting); use nonfinite='raise'."
            )

    def watch(self, models: Mapping[str, nn.Module]) -> None:
        """Record, after each forward of each model (role -> model), whether its logits were finite."""
        if self._handles:
            return
        for role, model in models.items():

            def record(module: nn.Module, args: Any, output: Any, role: str = role) -> None:
                logits = getattr(output, "logits", None)
                if isinstance(logits, torch.Tensor):
                    self.record(role, logits)

            self._handles.append(model.register_forward_hook(record))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def record(self, role: str, values: torch.Tensor) -> None:
        """Note whether ``values`` (the logits, or what stands in for them) of ``role`` are all finite."""
        self.record_flag(role, torch.isfinite(values.detach().sum(dtype=torch.float32)))

    def record_flag(self, role: str, finite: torch.Tensor) -> None:
        """Note ``finite`` (0-dim bool: whether ``role``'s outputs were all finite), as a loss reports it."""
        self.finite[role] = finite

    def reset(self) -> None:
        """Forget the previous batch's records (call at the start of each training batch)."""
        self.finite = {}

    def check(self, loss: torch.Tensor, step: int) -> bool:
        """True when the batch must be skipped, False when ``loss`` is finite; raises otherwise (see the class)."""
        if bool(torch.isfinite(loss.detach()).all()):
            self._skipped_in_a_row = 0
            return False
        bad = [role for role, finite in self.finite.items() if not bool(finite)]
        if bad:
            cause = f"the {' and the '.join(bad)} produced non-finite logits (NaN or inf)"
        else:
            checked = ", ".join(self.finite) or "no model"
            cause = f"the logits ({checked}) are finite, so the loss computation itself overflowed"
        message = f"Non-finite training loss ({loss.detach().float().mean().item()}) at global step {step}: {cause}."
        hint = (
            " Usual causes: a learning rate too high for these weights, fp16 overflow (use bf16 or 32-bit "
            "precision), or broken model weights."
        )
        if self.policy == "raise":
            raise RuntimeError(
                message + " The model was not updated with it." + hint + " To skip such batches "
                "instead, set training.nonfinite='skip' (Hydra: method.training.nonfinite=skip)."
            )
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise RuntimeError(
                message + f" That is {self._skipped_in_a_row} skipped batches in a row, so the "
                "run is stopped: the model no longer produces usable outputs." + hint
            )
        rank_zero_warn(message + " Skipping this batch (nonfinite='skip').")
        return True
