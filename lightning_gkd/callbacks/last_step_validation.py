"""Validate at the last optimizer step: Lightning validates every ``val_check_interval`` batches only, so a run of
``max_steps=120`` at ``val_check_interval=50`` ends at step 120 with the metrics of step 100."""

from __future__ import annotations

from typing import Any

import lightning as L


class LastStepValidation(L.Callback):
    """At the batch that completes ``trainer.max_steps``, ask the trainer to stop: Lightning then runs its
    validation for that batch (a requested stop validates first), once, also where the interval falls on it. With
    a validation loop configured (``limit_val_batches`` > 0 and a validation dataloader) the last step's metrics are
    then always in the logs and the checkpoint callbacks see them."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True
