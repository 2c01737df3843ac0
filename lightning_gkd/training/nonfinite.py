"""The non-finite loss guard: which model produced non-finite logits, and whether to stop or skip the batch.

Under several processes the ranks agree before anything is updated (``NonFiniteGuard.check_ranks``: one all-reduce
of a per-rank flag per step): a rank whose loss is non-finite would otherwise raise alone while the others wait in
backward's gradient all-reduce until the process-group timeout. Every rank raises ``NonFiniteLoss`` together, naming
the rank(s) and model(s) at fault, and ``NonFiniteStop`` saves one checkpoint of the state before the bad step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_gkd.training.checkpoint_io import inside_accumulation_window, resume_checkpoint_path
from lightning_gkd.training.teacher_outage import StopCheckpoint, failed_ranks, rank_messages, training_started

NonFinitePolicy = Literal["raise", "skip"]
#: With nonfinite="skip", this many non-finite batches in a row stop the run: the model is broken, not unlucky.
MAX_CONSECUTIVE_SKIPS = 16
_CAUSES = (
    " Usual causes: a learning rate too high for these weights, fp16 overflow (use bf16 or 32-bit "
    "precision), or broken model weights."
)


class NonFiniteLoss(RuntimeError):
    """A non-finite training loss stopped the run. ``before_update``: raised before anything was updated with it
    (``nonfinite="raise"``; ``NonFiniteStop`` saves the state then), False after too many skipped batches."""

    def __init__(self, message: str, *, before_update: bool = True) -> None:
        super().__init__(message)
        self.before_update = before_update


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

    def problem(self, loss: torch.Tensor, step: int) -> str | None:
        """None when ``loss`` is finite, else what went wrong: the loss, the global ``step`` and the model(s) whose
        outputs were non-finite (or, when all were finite, that the loss computation overflowed)."""
        if bool(torch.isfinite(loss.detach()).all()):
            return None
        bad = [role for role, finite in self.finite.items() if not bool(finite)]
        if bad:
            cause = f"the {' and the '.join(bad)} produced non-finite logits (NaN or inf)"
        else:
            checked = ", ".join(self.finite) or "no model"
            cause = f"the logits ({checked}) are finite, so the loss computation itself overflowed"
        return f"Non-finite training loss ({loss.detach().float().mean().item()}) at global step {step}: {cause}."

    def check_ranks(self, loss: torch.Tensor, step: int, trainer: L.Trainer) -> None:
        """Under several processes (``trainer.world_size`` > 1): raise ``NonFiniteLoss`` on every rank when the loss
        is non-finite on any rank, naming each such rank and the model(s) at fault there. Call it on every rank at
        the same point, before backward: one all-reduce of ``world_size`` flags per step (the messages are gathered
        only when some rank failed). In one process it does nothing (``check`` decides)."""
        world_size = trainer.world_size
        if world_size < 2:
            return
        failed = failed_ranks(~torch.isfinite(loss.detach()).all(), trainer)  # one host sync: the all-reduce's
        if not failed:
            return
        messages = rank_messages(self.problem(loss, step), world_size)
        causes = " ".join(f"Rank {rank} of {world_size}: {messages[rank]}" for rank in failed)
        raise NonFiniteLoss(
            f"{causes} All {world_size} ranks stopped together, before this step's update: the model was not "
            f"updated with it.{_CAUSES} (nonfinite='skip' is for a single process only.)"
        )

    def check(self, loss: torch.Tensor, step: int) -> bool:
        """True when the batch must be skipped, False when ``loss`` is finite; raises otherwise (see the class)."""
        message = self.problem(loss, step)
        if message is None:
            self._skipped_in_a_row = 0
            return False
        if self.policy == "raise":
            raise NonFiniteLoss(
                message + " The model was not updated with it." + _CAUSES + " To skip such batches "
                "instead, set training.nonfinite='skip' (Hydra: method.training.nonfinite=skip)."
            )
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteLoss(
                message + f" That is {self._skipped_in_a_row} skipped batches in a row, so the "
                "run is stopped: the model no longer produces usable outputs." + _CAUSES,
                before_update=False,
            )
        rank_zero_warn(message + " Skipping this batch (nonfinite='skip').")
        return True


class NonFiniteStop(StopCheckpoint):
    """When a non-finite loss stops a fit before anything was updated with it (``NonFiniteLoss``): saves
    ``<checkpoint dir>/last.ckpt``, the state before that step, and says where it is and what a resume does (it
    trains on that same batch again from those weights). ``CausalLMModule.configure_callbacks`` adds it."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, NonFiniteLoss) or not exception.before_update or not training_started(trainer):
            return
        path = resume_checkpoint_path(trainer)
        if inside_accumulation_window(trainer):
            rank_zero_warn(
                "The non-finite loss came inside a gradient-accumulation window (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): no checkpoint saved now; the last regular one is in "
                f"{path.parent}."
            )
            return
        self.save(trainer)
        rank_zero_warn(
            f"Stopped on a non-finite loss before step {trainer.global_step + 1}; saved {path}, the state before that "
            f"step (nothing updated with it). A resume (ckpt_path={path}, or ckpt_path=last) trains on the same batch "
            "again from these weights: remove the cause first (the data of that batch, fp16 precision, ...)."
        )
