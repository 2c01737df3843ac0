"""Signals in the resume tests: a callback they name by dotted path in a Hydra override
(``+callbacks.sigterm._target_=...``), and a command-line run signalled once it has trained a few steps."""

import os
import signal
import subprocess
import time
from pathlib import Path

import lightning as L


class SigtermAt(L.Callback):
    """Sends this process SIGTERM at the end of optimizer step ``step`` (as a scheduler's preemption would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def child_default_sigint() -> None:
    """Python's default SIGINT disposition for a child (``preexec_fn``): a child of a shell script or CI runner may
    inherit an ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_after_first_checkpoint(
    command: list[str], *, cwd: Path, run_dir: Path, log: Path, signum: int, timeout: float = 180
) -> subprocess.Popen:
    """Run ``command`` (a ``lightning-gkd`` launch writing to ``run_dir``) with its output in ``log``; once
    ``run_dir/checkpoints`` holds a ``step*.ckpt`` (it trained that far), send it ``signum`` and wait for it to
    exit (120 s at most; killed otherwise). Returns the finished process; fails the test when the run ends or
    ``timeout`` seconds pass before a checkpoint."""
    with open(log, "w") as sink:  # a file, not a pipe: a full pipe would block the run
        process = subprocess.Popen(
            command, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, text=True, preexec_fn=child_default_sigint
        )
        try:
            deadline = time.monotonic() + timeout
            while not list((run_dir / "checkpoints").glob("step*.ckpt")):
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no checkpoint within {timeout} s"
                time.sleep(0.2)
            process.send_signal(signum)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    return process
