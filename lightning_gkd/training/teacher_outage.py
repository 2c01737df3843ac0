"""TeacherOutage: when a teacher server stays down, save a checkpoint to resume from and say how.

A callback the method owns (``GKDModule.configure_callbacks`` adds it when a teacher lives outside the process).
The server teacher retries transient failures itself; when it gives up it raises ``TeacherUnavailable`` from the
training step, before the batch is trained on. Lightning then calls callbacks' ``on_exception``: the loop has
finished every earlier batch and none of this one, so a checkpoint saved here resumes at this batch (the loader
resumes after the batches whose step ran). Inside a gradient-accumulation window the earlier micro-batches'
gradients are not in any checkpoint: nothing is saved then, and the message points at the last regular checkpoint.

Under several processes a server can fail for one rank only (each node has its own, or one rank's connection
breaks). That rank would stop while the others wait in the step's next collective (DDP's gradient all-reduce in
backward) until the process-group timeout. ``stop_ranks_together`` makes the ranks agree first: one all-reduce of a
per-rank flag after each step's teacher calls, and when any rank failed, every rank raises ``TeacherUnavailable``
naming the ranks and their errors. Every rank then reaches ``on_exception`` together, which
``Trainer.save_checkpoint`` needs (rank 0 writes, every rank waits at its barrier); the hint is printed by rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gkd.teachers.base import TeacherUnavailable
from lightning_gkd.training.checkpoint_io import inside_accumulation_window, resume_checkpoint_path


def stop_ranks_together(failure: TeacherUnavailable | None, trainer: L.Trainer) -> None:
    """Under several processes: raise ``TeacherUnavailable`` on every rank when the teacher was unavailable to any
    rank in this step (``failure``: this rank's, None when its teacher answered). One all-reduce of
    ``world_size`` flags; the failures' messages are gathered only when there are some. In one process it does
    nothing: the caller re-raises its own failure."""
    world_size = trainer.world_size
    if world_size < 2:
        return
    flags = torch.zeros(world_size, device=trainer.strategy.root_device)
    flags[trainer.global_rank] = float(failure is not None)
    failed = [rank for rank, flag in enumerate(trainer.strategy.reduce(flags, reduce_op="sum").tolist()) if flag]
    if not failed:
        return
    messages: list[str | None] = [None] * world_size
    torch.distributed.all_gather_object(messages, None if failure is None else str(failure))
    causes = "; ".join(f"rank {rank} of {world_size}: {messages[rank]}" for rank in failed)
    raise TeacherUnavailable(f"{causes}; all {world_size} ranks stopped together, before this step's update") from (
        failure
    )


class TeacherOutage(L.Callback):
    """Saves ``<checkpoint dir>/last.ckpt`` (the ``ModelCheckpoint``'s folder, else ``<root>/checkpoints``) when a
    fit stops on ``TeacherUnavailable`` at an optimizer-step boundary, so ``ckpt_path=last`` resumes there."""

    def __init__(self) -> None:
        self.saved_path: Path | None = None
        self._saving = False

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, TeacherUnavailable):
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
        self._saving = True
        try:
            trainer.save_checkpoint(path)
        finally:
            self._saving = False
        self.saved_path = path
        rank_zero_warn(
            f"{exception.service} is unavailable ({exception}). Stopped before step {trainer.global_step + 1}, "
            f"nothing trained on this batch; saved {path}. {exception.remedy}, then resume with "
            f"ckpt_path={path} (or ckpt_path=last)."
        )

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

    def run_summary(self) -> dict[str, str | None]:
        return {"resume_from": str(self.saved_path)} if self.saved_path else {}
