"""SignalCheckpoint: on SIGTERM, SIGUSR1 or a first Ctrl-C (SIGINT), finish the current step, save a checkpoint and
stop cleanly; a second Ctrl-C aborts at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

SIGINT_EXIT_STATUS = 130  # the shell's "stopped by Ctrl-C": `lightning-gkd ... && next-step` does not go on


def ctrl_c_notice(handler: Any, pid: int) -> str:
    """What Ctrl-C does to a run whose SIGINT handler was ``handler`` before fit (process ``pid``)."""
    if handler is signal.default_int_handler or handler == signal.SIG_DFL:
        return "Ctrl-C stops the run after the current training step with a checkpoint to resume from."
    if handler == signal.SIG_IGN:
        return (
            "Ctrl-C will not stop this run: SIGINT is ignored in this process (inherited: a background job of a "
            "script, `cmd &` or `nohup cmd &`, starts with SIGINT ignored). To stop it after the current step "
            f"with a checkpoint, send SIGTERM: kill -TERM {pid}. To have Ctrl-C work, start it in the foreground, or "
            "in a script as `( trap - INT; cmd ) &` or after `set -m`."
        )
    return (
        f"Ctrl-C is left to the SIGINT handler installed before fit ({handler!r}); SIGTERM stops the run after "
        "the current step with a checkpoint."
    )


class SignalCheckpoint(L.Callback):
    """Save ``<dirpath>/<filename>.ckpt`` when the run is asked to stop by SIGTERM, SIGUSR1 or Ctrl-C, then stop.

    Lightning already turns SIGTERM into a clean stop: its handler sets a flag, and after the current optimizer
    step the loop raises ``SIGTERMException`` (a ``SystemExit`` with code 0, on every rank) that reaches each
    callback's ``on_exception``. This callback saves the checkpoint there, at a step boundary. SIGUSR1 (a common
    "about to be preempted" warning) is routed into the same path, unless something already handles it (Lightning
    does for SLURM auto-requeue, where it saves ``hpc_ckpt_*.ckpt`` and requeues the job itself).

    Ctrl-C (SIGINT) takes the same path: the first one says so and asks every rank to stop after the optimizer
    step in progress (the ranks agree on it at the end of each optimizer step's batch, so all stop at the same
    step; a validation due at that step is cut short, as with SIGTERM); a second one raises ``KeyboardInterrupt``
    at once (Lightning then shuts down without saving). The handler is installed only in the main thread and only
    over Python's default one (a deliberately ignored SIGINT stays ignored), and the previous handler is restored
    after fit. Once per callback, rank zero logs whether Ctrl-C stops the run this way: a process started as a
    background job of a script (``cmd &`` without job control, ``nohup cmd &``) inherits SIGINT ignored, and then
    Ctrl-C cannot stop it at all; the message says to send SIGTERM instead, or how to start it with Ctrl-C working.

    Resume with ``trainer.fit(..., ckpt_path=saved_path)`` (Hydra: ``ckpt_path=<path>`` or ``ckpt_path=last``).
    ``lightning-gkd`` prints the path and exits with status 0 after SIGTERM/SIGUSR1, 130 after Ctrl-C. The default
    ``filename="last"`` overwrites ``last.ckpt`` (written atomically by ``SafeCheckpointIO``), so "resume from
    last.ckpt" is right after a signal too.
    """

    def __init__(self, dirpath: str | Path, filename: str = "last") -> None:
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.saved_path: Path | None = None
        self.signal_name: str | None = None
        self.stopped_by: str | None = None  # the signal that stopped the latest fit
        self._sigint_pending = False  # a first Ctrl-C: stop after this optimizer step
        self._stepped = False
        self._previous_sigint: Any = None
        self._announce = True  # global rank zero prints the Ctrl-C notice
        self._told_ctrl_c = False  # whether Ctrl-C handling is active was logged

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

    def _route_sigint(self, trainer: L.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread() or self._previous_sigint is not None:
            return
        current = signal.getsignal(signal.SIGINT)
        if current is signal.default_int_handler or current == signal.SIG_DFL:
            self._previous_sigint = current
            self._sigint_pending = False
            self._announce = trainer.is_global_zero
            signal.signal(signal.SIGINT, self._on_sigint)
        if not self._told_ctrl_c:
            self._told_ctrl_c = True
            rank_zero_info(ctrl_c_notice(current, os.getpid()))

    def _restore_sigint(self) -> None:
        if self._previous_sigint is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, self._previous_sigint)
        self._previous_sigint = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self._sigint_pending:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now, without waiting for the step
        self._sigint_pending = True
        if self._announce:
            print(
                "\nCtrl-C: stopping after the current training step and saving a checkpoint to resume from. "
                "Press Ctrl-C again to abort at once without saving.",
                file=sys.stderr,
                flush=True,
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stopped_by = None

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._route_sigusr1()
        self._route_sigint(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._route_sigusr1()
        self._route_sigint(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._stepped = True  # this batch ends an optimizer step (on every rank alike)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        # After each optimizer step every rank is here: agree whether any rank saw a Ctrl-C, so all stop after the
        # same step (Lightning itself only reads rank zero's stop flag, at the next step's start).
        if not self._stepped:
            return
        self._stepped = False
        pending = self._sigint_pending
        if trainer.world_size > 1:
            pending = trainer.strategy.reduce_boolean_decision(pending, all=False)
        if pending and self.signal_name is None:
            self.signal_name = "SIGINT"
            self._sigint_pending = True  # a second Ctrl-C on any rank now aborts
            connector = getattr(trainer, "_signal_connector", None)
            if connector is not None and hasattr(connector, "received_sigterm"):
                connector.received_sigterm = True  # Lightning raises SIGTERMException at the end of this batch
            else:  # pragma: no cover - a Lightning without the flag: its SIGTERM handler sets it
                handler = signal.getsignal(signal.SIGTERM)
                if callable(handler):
                    handler(signal.SIGTERM, None)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        name = self.stopped_by = self.signal_name or "SIGTERM"
        if trainer.global_step == 0:
            rank_zero_info(f"Received {name} before the first optimizer step: stopping; nothing to save.")
            return
        trainer.save_checkpoint(self.path, weights_only=False)  # the full state: resumable
        self.saved_path = self.path
        rank_zero_info(
            f"Received {name}: stopped after step {trainer.global_step} and saved {self.path}. Resume "
            f"with ckpt_path={self.path}"
        )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_sigint()  # (Lightning's teardown also restores the handlers it found before fit)

    def run_summary(self) -> dict[str, Any]:
        """What ``lightning-gkd``'s summary reports: the checkpoint to resume from and the signal, if one stopped
        the run."""
        return {"resume_from": str(self.saved_path) if self.saved_path else None, "stop_signal": self.stopped_by}
