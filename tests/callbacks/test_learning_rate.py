"""LearningRateLogger: train/lr in the logs (our metric naming), and no error without a logger."""

from __future__ import annotations

import csv
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, SFTModule
from lightning_gkd.callbacks import LearningRateLogger
from lightning_gkd.callbacks.learning_rate import _ours


def fit(tmp_path, student, tokenizer, toy_rows, csv_log, optimizer=None) -> tuple[L.Trainer, LearningRateLogger]:
    monitor = LearningRateLogger()
    trainer = small_trainer(tmp_path, csv=csv_log, max_steps=4, callbacks=[monitor])
    module = SFTModule(
        student,
        tokenizer,
        training={
            "optimizer": optimizer or partial(torch.optim.SGD, lr=0.04),
            "scheduler": partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
        },
    )
    trainer.fit(module, datamodule=ChatDataModule(tokenizer, toy_rows["train"], batch_size=4))
    return trainer, monitor


def test_the_rate_of_each_step_is_logged_as_train_lr(tmp_path, student, tokenizer, toy_rows):
    fit(tmp_path, student, tokenizer, toy_rows, csv_log=True)
    with open(tmp_path / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert not any(name.startswith("lr-") for name in rows[0])
    assert [float(r["train/lr"]) for r in rows if r.get("train/lr")] == pytest.approx([0.04, 0.04, 0.02, 0.02])


def test_without_a_logger_it_still_reaches_the_callback_metrics(tmp_path, student, tokenizer, toy_rows):
    # Lightning's LearningRateMonitor raises "Cannot use `LearningRateMonitor` callback with `Trainer` that has
    # no logger" here
    trainer, monitor = fit(tmp_path, student, tokenizer, toy_rows, csv_log=False)
    assert float(trainer.callback_metrics["train/lr"]) == pytest.approx(0.02)
    assert monitor.lrs["train/lr"] == pytest.approx([0.04, 0.04, 0.02, 0.02])


def test_names_follow_lightnings_suffixes_and_keep_a_schedulers_own_name():
    assert _ours("lr-AdamW", torch.optim.AdamW) == "train/lr"
    assert _ours("lr-AdamW/pg2", torch.optim.AdamW) == "train/lr/pg2"
    assert _ours("lr-AdamW-1", torch.optim.AdamW) == "train/lr-1"
    assert _ours("my-schedule", torch.optim.AdamW) == "my-schedule"
