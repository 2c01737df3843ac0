"""TeacherOutage: when a teacher server stays down, save a checkpoint to resume from and say how.

A callback the method owns (``GKDModule.configure_callbacks`` adds it when a teacher lives outside the process).
The server teacher retries transient failures itself; when it gives up it raises ``TeacherUnavailable`` from the
training step, before the batch is trained on. Lightning then calls callbacks' ``on_exception``: the loop has
finished every earlier batch and none of this one, so a checkpoint saved here resumes at this batch (the loader
resumes after the batches whose step ran). Inside a gradient-accumulation window the earlier micro-batches'
gradients are not in any checkpoint: nothing is saved then, and the message points at the last regular checkpoint.
The same holds when the teacher fails during a validation: the checkpoint is the state after the step that
validation follows, recorded as a validation not yet begun, so the resumed run validates again and trains on.

Under several processes a server can fail for one rank only (each node has its own, or one rank's connection
breaks). That rank would stop while the others wait in the step's next collective (DDP's gradient all-reduce in
backward, or validation's metric sync) until the process-group timeout. ``stop_ranks_together`` makes the ranks agree
first: one all-reduce of a per-rank flag after each training step's (and each validation batch's) teacher calls, and
when any rank failed, every rank raises ``TeacherUnavailable`` naming the ranks and their errors. Every rank then
reaches ``on_exception`` together, which ``Trainer.save_checkpoint`` needs (rank 0 writes, every rank waits at its
barrier); the hint is printed by rank 0.

``StopCheckpoint`` is that saving, shared with the non-finite loss stop (``training.nonfinite.NonFiniteStop``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gkd.teachers.base import TeacherUnavailable
from lightning_gkd.training.checkpoint_io import inside_accumulation_window, resume_checkpoint_path

#: Where ``stop_ranks_together`` says the ranks stopped: in a training step, or in a validation.
BEFORE_UPDATE = "before this step's update"
IN_VALIDATION = "in validation"


def failed_ranks(failed: bool | torch.Tensor, trainer: L.Trainer) -> list[int]:
    """The ranks for which ``failed`` (this rank's flag: a bool, or a 0-dim tensor read without a host sync of its
    own) is true: one all-reduce of ``world_size`` flags. Every rank must call it at the same point; in one process
    it is ``[0]`` or ``[]`` without any collective."""
    world_size = trainer.world_size
    if world_size < 2:
        return [0] if bool(failed) else []
    flags = torch.zeros(world_size, device=trainer.strategy.root_device)
    flags[trainer.global_rank] = failed if isinstance(failed, torch.Tensor) else float(failed)
    return [rank for rank, flag in enumerate(trainer.strategy.reduce(flags, reduce_op="sum").tolist()) if flag]


def rank_messages(message: str | None, world_size: int) -> list[str | None]:
    """Every rank's ``message`` (None where it has none), by rank: one ``all_gather_object``, called on every rank
    once ``failed_ranks`` said some rank failed."""
    messages: list[str | None] = [None] * world_size
    torch.distributed.all_gather_object(messages, message)
    return messages


def stop_ranks_together(failure: TeacherUnavailable | None, trainer: L.Trainer, *, where: str = BEFORE_UPDATE) -> None:
    """Under several processes: raise ``TeacherUnavailable`` on every rank when the teacher was unavailable to any
    rank in this step or validation batch (``failure``: this rank's, None when its teacher answered). One all-reduce
    of ``world_size`` flags; the failures' messages are gathered only when there are some. ``where`` ends the message
    (``BEFORE_UPDATE``, ``IN_VALIDATION``). In one process it does nothing: the caller re-raises its own failure."""
    world_size = trainer.world_size
    if world_size < 2:
        return
    failed = failed_ranks(failure is not None, trainer)
    if not failed:
        return
    messages = rank_messages(None if failure is None else str(failure), world_size)
    causes = "; ".join(f"rank {rank} of {world_size}: {messages[rank]}" for rank in failed)
    raise TeacherUnavailable(f"{causes}; all {world_size} ranks stopped together, {where}") from failure


def mark_validation_unstarted(checkpoint: dict[str, Any]) -> None:
    """Record the fit loop's validation in ``checkpoint`` (saved while a validation ran) as one that has not begun:
    Lightning then resumes by running the whole validation again before the next training step. (Recorded as it
    stands, a resume would count the batches validated before the stop as done and still read the validation
    loader from its first batch.)"""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = fit_loop.get("epoch_loop.val_loop.batch_progress")
    if not isinstance(progress, dict):
        return
    current, total = progress.get("current"), progress.get("total")
    if not isinstance(current, dict) or not isinstance(total, dict):
        return
    before = total["completed"] - current["completed"]  # this epoch's validation batches before this validation
    # "restarted mid-evaluation" with none of its batches done: ready = started = processed + 1
    for scope, done in ((current, 0), (total, before)):
        scope["processed"] = scope["completed"] = done
        scope["ready"] = scope["started"] = done + 1
    progress["is_last_batch"] = False


def training_started(trainer: L.Trainer) -> bool:
    """Whether ``trainer`` is fitting past its sanity check: a checkpoint saved now is one to resume training from
    (not so in the sanity check, nor in ``trainer.validate``)."""
    return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking


class StopCheckpoint(L.Callback):
    """Saves ``<checkpoint dir>/last.ckpt`` (the ``ModelCheckpoint``'s folder, else ``<root>/checkpoints``) when a
    fit stops on an exception a subclass's ``on_exception`` handles (``save``), at an optimizer-step boundary, so
    ``ckpt_path=last`` resumes there: before the failed training batch (nothing of it trained), or before a
    validation cut short (validated again on resume). Nothing is saved inside an accumulation window, in the sanity
    check or outside a fit. ``on_exception`` runs on every rank, as ``Trainer.save_checkpoint`` needs: raise the
    exception on every rank."""

    def __init__(self) -> None:
        self.saved_path: Path | None = None
        self._saving = False
        self._in_validation = False

    def save(self, trainer: L.Trainer) -> Path | None:
        """Save the checkpoint to resume from; None (nothing saved) inside an accumulation window, in the sanity
        check or outside a fit (``training_started``)."""
        if not training_started(trainer) or inside_accumulation_window(trainer):
            return None
        path = resume_checkpoint_path(trainer)
        self._saving, self._in_validation = True, bool(trainer.validating)
        try:
            trainer.save_checkpoint(path)
        finally:
            self._saving = self._in_validation = False
        self.saved_path = path
        return path

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # The failed batch was fetched and started but never processed; recorded as such, Lightning would resume as
        # from a checkpoint taken inside a step and count one more step for the logger. Record the state as it was
        # after the last finished batch: nothing in flight.
        if not self._saving:
            return
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        for scope in loop.get("epoch_loop.batch_progress", {}).values():
            if isinstance(scope, dict):
                scope["ready"] = scope["started"] = scope["completed"]
        step = loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {}).get("step", {})
        for scope in step.values():
            scope["ready"] = scope["completed"]
        if self._in_validation:
            mark_validation_unstarted(checkpoint)

    def run_summary(self) -> dict[str, str | None]:
        return {"resume_from": str(self.saved_path)} if self.saved_path else {}


class TeacherOutage(StopCheckpoint):
    """Saves ``<checkpoint dir>/last.ckpt`` (the ``ModelCheckpoint``'s folder, else ``<root>/checkpoints``) when a
    fit stops on ``TeacherUnavailable`` at an optimizer-step boundary, so ``ckpt_path=last`` resumes there."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, TeacherUnavailable):
            return
        if not training_started(trainer):
            where = "in the sanity check, before any training" if trainer.sanity_checking else "outside training"
            rank_zero_warn(
                f"{exception.service} is unavailable ({exception}) {where}: no checkpoint saved. "
                f"{exception.remedy}, then start it again."
            )
            return
        path = resume_checkpoint_path(trainer)
        if inside_accumulation_window(trainer):
            processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
            rank_zero_warn(
                f"{exception.service} is unavailable ({exception}). It failed inside a gradient-accumulation window "
                f"(batch {processed} of the epoch, accumulate_grad_batches={trainer.accumulate_grad_batches}): no "
                f"checkpoint saved now. Resume from the last regular checkpoint in {path.parent} (ckpt_path=last) once "
                "it is up."
            )
            return
        validating = bool(trainer.validating)
        self.save(trainer)
        stopped = (
            f"Stopped in the validation after step {trainer.global_step}; saved {path} (the state after that step: "
            "the resumed run validates again, then trains on)."
            if validating
            else f"Stopped before step {trainer.global_step + 1}, nothing trained on this batch; saved {path}."
        )
        rank_zero_warn(
            f"{exception.service} is unavailable ({exception}). {stopped} {exception.remedy}, then resume with "
            f"ckpt_path={path} (or ckpt_path=last)."
        )
