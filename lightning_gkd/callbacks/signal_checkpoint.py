"""SignalCheckpoint: on SIGTERM or SIGUSR1, finish the current step, save a checkpoint and stop cleanly."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException


class SignalCheckpoint(L.Callback):
    """Save ``<dirpath>/<filename>.ckpt`` when the run is asked to stop by SIGTERM or SIGUSR1, then stop cleanly.

    Lightning already turns SIGTERM into a clean stop: its handler sets a flag, and after the current optimizer
    step the loop raises ``SIGTERMException`` (a ``SystemExit`` with code 0, on every rank) that reaches each
    callback's ``on_exception``. This callback saves the checkpoint there, at a step boundary. SIGUSR1 (a common
    "about to be preempted" warning) is routed into the same path, unless something already handles it (Lightning
    does for SLURM auto-requeue, where it saves ``hpc_ckpt_*.ckpt`` and requeues the job itself).

    Resume with ``trainer.fit(..., ckpt_path=saved_path)`` (Hydra: ``ckpt_path=<path>``). ``lightning-gkd``
    prints the path and exits with status 0. The default ``filename="last"`` overwrites ``last.ckpt`` (written
    atomically by ``SafeCheckpointIO``), so "resume from last.ckpt" is right after a signal too.
    """

    def __init__(self, dirpath: str | Path, filename: str = "last") -> None:
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.saved_path: Path | None = None
        self.signal_name: str | None = None

    def _route_sigusr1(self) -> None:
        # Installed after Lightning registered its handlers (which happens after on_fit_start); Lightning's
        # teardown restores the SIGUSR1 handler it found then, so nothing is left behind after fit.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGUSR1, self._on_sigusr1)

    def _on_sigusr1(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = "SIGUSR1"
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):  # Lightning's SIGTERM handler: stop after this step, on every rank
            handler(signal.SIGTERM, frame)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._route_sigusr1()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._route_sigusr1()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        name = self.signal_name or "SIGTERM"
        if trainer.global_step == 0:
            rank_zero_info(f"Received {name} before the first optimizer step: stopping; nothing to save.")
            return
        trainer.save_checkpoint(self.path)
        self.saved_path = self.path
        rank_zero_info(
            f"Received {name}: stopped after step {trainer.global_step} and saved {self.path}. Resume "
            f"with ckpt_path={self.path}"
        )

    def run_summary(self) -> dict[str, Any]:
        """What ``lightning-gkd``'s summary reports: the checkpoint to resume from, if a signal stopped the run."""
        return {"resume_from": str(self.saved_path) if self.saved_path else None}
