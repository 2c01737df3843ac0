"""PrintMetricsCallback: the progress lines a SLURM log gets (step/total, %, elapsed, time left, metrics)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from lightning_gkd.callbacks.print_metrics import PrintMetricsCallback, total_steps


def fake_trainer(step: int, metrics: dict, max_steps: int = 200, log_every: int = 10) -> SimpleNamespace:
    return SimpleNamespace(
        global_step=step,
        max_steps=max_steps,
        log_every_n_steps=log_every,
        callback_metrics={k: torch.tensor(v) for k, v in metrics.items()},
        is_global_zero=True,
        sanity_checking=False,
    )


METRICS = {
    "train/completion_length": 4.5,
    "train/on_policy": 1.0,
    "train/on_policy_fraction": 0.5,
    "train/tokens_per_sec": 4184.4,
    "train/lr": 9.5e-4,
    "train/loss": 0.2256,
    "val/loss": 0.3,
}


def test_a_line_has_step_of_total_percent_times_and_the_train_metrics_in_order(monkeypatch, capsys):
    clock = iter([100.0, 110.0])  # train start, then 10 s later
    monkeypatch.setattr("lightning_gkd.callbacks.print_metrics.time.perf_counter", lambda: next(clock))
    printer = PrintMetricsCallback()
    printer.on_train_start(fake_trainer(0, {}), None)
    printer.on_train_batch_end(fake_trainer(20, METRICS), None, None, None, 19)
    line = capsys.readouterr().out.strip()
    # 20 steps in 10 s: 180 more take 90 s; the coin train/on_policy is left out, val/ too
    assert line == (
        "step 20/200 (10%) | 0:00:10 elapsed, 0:01:30 left | train/loss=0.2256 train/lr=0.00095 "
        "train/tokens_per_sec=4184 train/on_policy_fraction=0.5 train/completion_length=4.5"
    )
    assert printer.history == [
        (20, {k: pytest.approx(v) for k, v in METRICS.items() if k.startswith("train/") and k != "train/on_policy"})
    ]


def test_a_resumed_fit_extrapolates_from_its_own_steps(monkeypatch, capsys):
    clock = iter([0.0, 30.0])
    monkeypatch.setattr("lightning_gkd.callbacks.print_metrics.time.perf_counter", lambda: next(clock))
    printer = PrintMetricsCallback(every_n_steps=10)
    printer.on_train_start(fake_trainer(100, {}), None)  # resumed at step 100
    printer.on_train_batch_end(fake_trainer(110, {"train/loss": 1.0}), None, None, None, 9)
    assert "step 110/200 (55%) | 0:00:30 elapsed, 0:04:30 left | train/loss=1" in capsys.readouterr().out


def test_cadence_follows_log_every_n_steps_and_keeps_long_runs_to_about_100_lines():
    printer = PrintMetricsCallback()
    assert printer.cadence(fake_trainer(0, {}, log_every=10), 200.0) == 10
    assert printer.cadence(fake_trainer(0, {}, log_every=10), 100_000.0) == 1000  # a multiple of log_every
    assert printer.cadence(fake_trainer(0, {}, log_every=1), 4.0) == 1
    assert printer.cadence(fake_trainer(0, {}, log_every=10), math.inf) == 10
    assert PrintMetricsCallback(every_n_steps=7).cadence(fake_trainer(0, {}), 100_000.0) == 7


def test_lines_on_cadence_and_at_the_last_step_once_per_step(capsys):
    printer = PrintMetricsCallback(every_n_steps=4)
    for step in [0, 1, 2, 3, 4, 4, 5, 8, 10]:  # 4 twice: gradient accumulation repeats a step
        printer.on_train_batch_end(fake_trainer(step, {"train/loss": 1.0}, max_steps=10), None, None, None, 0)
    steps = re.findall(r"^step (\d+)/10", capsys.readouterr().out, flags=re.M)
    assert steps == ["4", "8", "10"]


def test_validation_line_and_no_total_when_unknown(capsys):
    printer = PrintMetricsCallback()
    printer.on_validation_end(fake_trainer(50, METRICS), None)
    assert capsys.readouterr().out.strip() == "step 50/200 validation | val/loss=0.3"
    unbounded = fake_trainer(3, {"train/loss": 2.0}, max_steps=-1, log_every=1)
    unbounded.estimated_stepping_batches = math.inf
    assert total_steps(unbounded) == math.inf
    printer.on_train_batch_end(unbounded, None, None, None, 2)
    assert capsys.readouterr().out.startswith("step 3 | ")
