"""LastStepValidation: a run whose max_steps is not a multiple of val_check_interval validates at its last step too,
once; one whose max_steps is a multiple validates there once, as before."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, SFTModule
from lightning_gkd.callbacks import LastStepValidation


class ValidationSteps(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)


@pytest.mark.parametrize(
    ("max_steps", "with_callback", "expected"),
    [(12, True, [5, 10, 12]), (12, False, [5, 10]), (10, True, [5, 10]), (3, True, [3])],
)
def test_validation_at_the_last_step(max_steps, with_callback, expected, tmp_path, student, tokenizer, toy_rows):
    seen = ValidationSteps()
    trainer = small_trainer(
        tmp_path,
        max_steps=max_steps,
        val_check_interval=5,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[seen, *([LastStepValidation()] if with_callback else [])],
    )
    module = SFTModule(student, tokenizer, training={"optimizer": partial(torch.optim.SGD, lr=0.01)})
    data = ChatDataModule(tokenizer, toy_rows["train"][:16], toy_rows["val"][:4], batch_size=4)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == max_steps
    assert seen.steps == expected
    if with_callback:
        assert "val/loss" in trainer.callback_metrics
