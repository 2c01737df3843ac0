"""StepProgressBar: a bar in optimizer steps toward max_steps on a terminal, PrintMetricsCallback's lines elsewhere."""

from __future__ import annotations

import io
import re
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, SFTModule
from lightning_gkd.callbacks import PrintMetricsCallback, StepProgressBar


def fit(bar: StepProgressBar, student, tokenizer, toy_rows, tmp_path, extra=(), **trainer_kwargs) -> L.Trainer:
    settings = {
        "max_steps": 6,
        "limit_val_batches": 1,
        "val_check_interval": 3,
        "check_val_every_n_epoch": None,
        "num_sanity_val_steps": 0,
        **trainer_kwargs,
    }
    trainer = small_trainer(tmp_path, enable_progress_bar=True, callbacks=[bar, *extra], **settings)
    module = SFTModule(student, tokenizer, training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)})
    # 16 rows of 4: an epoch is 4 steps, so the 6 steps cross an epoch boundary
    trainer.fit(module, datamodule=ChatDataModule(tokenizer, toy_rows["train"][:16], toy_rows["val"], batch_size=4))
    return trainer


def test_on_a_terminal_one_bar_counts_steps_across_epochs(student, tokenizer, toy_rows, tmp_path, capsys):
    screen = io.StringIO()
    bar = StepProgressBar(console_kwargs={"force_terminal": True, "force_interactive": True, "file": screen})
    try:
        trainer = fit(bar, student, tokenizer, toy_rows, tmp_path)
    finally:
        import rich

        rich.reconfigure()  # the bar reconfigured rich's global console onto `screen`
    assert trainer.current_epoch >= 1 and trainer.global_step == 6
    task = bar.train_progress_bar
    assert (task.total, task.completed, task.description) == (6, 6, "step 6/6")
    drawn = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.getvalue())
    assert "step 6/6" in drawn and "Epoch" not in drawn
    assert "loss:" in drawn and "train/loss" not in drawn  # the bar's metrics, without their train/ prefix
    assert "step 3/6 (50%)" not in capsys.readouterr().out  # no lines on a terminal unless asked


def test_off_a_terminal_no_bar_and_a_line_every_few_steps(student, tokenizer, toy_rows, tmp_path, capsys):
    bar = StepProgressBar(every_n_steps=2)  # capsys: stdout is no terminal
    trainer = fit(bar, student, tokenizer, toy_rows, tmp_path)
    assert bar.is_disabled and bar.progress is None
    out = capsys.readouterr().out
    assert re.findall(r"^step (\d)/6 \((\d+)%\) \| \S+ elapsed, \S+ left \| train/loss=", out, flags=re.M) == [
        ("2", "33"),
        ("4", "67"),
        ("6", "100"),
    ]
    assert re.findall(r"^step (\d)/6 validation \| val/loss=", out, flags=re.M) == ["3", "6"]
    assert [step for step, _ in bar.lines.history] == [2, 3, 4, 6, 6]
    assert trainer.global_step == 6


@pytest.mark.parametrize("print_lines", [True, False])
def test_print_lines_overrides_the_terminal_check(print_lines, student, tokenizer, toy_rows, tmp_path, capsys):
    bar = StepProgressBar(every_n_steps=3, print_lines=print_lines)
    fit(bar, student, tokenizer, toy_rows, tmp_path, max_steps=3, limit_val_batches=0)
    assert ("step 3/3 (100%)" in capsys.readouterr().out) is print_lines


def test_a_print_metrics_callback_of_its_own_prints_the_lines_once(student, tokenizer, toy_rows, tmp_path, capsys):
    printer = PrintMetricsCallback(every_n_steps=3)  # callbacks=[default,print_metrics]
    fit(StepProgressBar(), student, tokenizer, toy_rows, tmp_path, extra=[printer], max_steps=3, limit_val_batches=0)
    assert capsys.readouterr().out.count("step 3/3 (100%)") == 1 and [s for s, _ in printer.history] == [3]
