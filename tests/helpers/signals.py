"""A callback the resume tests name by dotted path in a Hydra override (``+callbacks.sigterm._target_=...``)."""

import os
import signal

import lightning as L


class SigtermAt(L.Callback):
    """Sends this process SIGTERM at the end of optimizer step ``step`` (as a scheduler's preemption would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
