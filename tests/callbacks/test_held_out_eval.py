"""HeldOutEvaluation's recovered fraction of the teacher–student gap: in its results, held_out.json, the logger and
its table, from a real fit (more of the callback: tests/methods/test_sft.py)."""

import copy
import csv
import json
import signal
import subprocess
import sys
from functools import partial

import pytest
import torch
from helpers.fitting import small_trainer
from helpers.signals import signal_after_first_checkpoint

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.callbacks.held_out_eval import HeldOutEvaluation
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path


def fit(module, tokenizer, rows, tmp_path, held_out, max_steps):
    data = ChatDataModule(tokenizer, addition_rows("train", 64), test_data=rows, batch_size=8, max_length=64)
    small_trainer(tmp_path, csv=True, max_steps=max_steps, callbacks=[held_out]).fit(module, datamodule=data)


def logged(tmp_path):
    with open(tmp_path / "metrics.csv") as handle:
        return {key: float(value) for row in csv.DictReader(handle) for key, value in row.items() if value}


def test_the_gap_closed_is_reported_beside_the_scores(tmp_path):
    """The toy teacher (98% on the test split) and its student start (~21%): supervised KD for a few steps moves
    the student, and every report gives (after − before) / (teacher − before) of independently computed scores."""
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    teacher, student = load_causal_lm(asset_path("toy/teacher")), load_causal_lm(asset_path("toy/student_init"))
    rows = addition_rows("test", 48)
    expected_teacher = evaluate_generations(teacher, tokenizer, rows, max_new_tokens=8)["accuracy"]
    expected_before = evaluate_generations(copy.deepcopy(student), tokenizer, rows, max_new_tokens=8)["accuracy"]
    module = GKDModule(
        student,
        teacher,
        tokenizer,
        lmbda=0.0,
        divergence={"beta": 0.0},
        training={"optimizer": partial(torch.optim.AdamW, lr=3e-3)},
    )
    held_out = HeldOutEvaluation(max_new_tokens=8)
    fit(module, tokenizer, rows, tmp_path, held_out, max_steps=12)
    expected_after = evaluate_generations(module.student, tokenizer, rows, max_new_tokens=8)["accuracy"]
    results = held_out.results
    assert (results["teacher"]["accuracy"], results["before"]["accuracy"], results["after"]["accuracy"]) == (
        expected_teacher,
        expected_before,
        expected_after,
    )
    assert expected_teacher > expected_before and expected_after != expected_before  # a gap, and a move
    gap = (expected_after - expected_before) / (expected_teacher - expected_before)
    assert results["gap_closed"] == {"accuracy": pytest.approx(gap, abs=1e-12)}
    saved = json.loads((tmp_path / "held_out.json").read_text())
    assert saved["gap_closed"]["accuracy"] == pytest.approx(gap, abs=1e-12)
    assert saved["num_rows"] == 48 and saved["max_new_tokens"] == 8
    metrics = logged(tmp_path)
    assert metrics["test/accuracy_gap_closed"] == pytest.approx(gap, abs=1e-6)
    assert metrics["test/accuracy_after"] == pytest.approx(expected_after)
    assert metrics["test/teacher_accuracy"] == pytest.approx(expected_teacher)
    assert f"gap closed {gap:.3f}" in held_out.table(48)


def test_without_a_gap_to_close_it_is_n_a_and_not_logged(student, teacher, tokenizer, tmp_path):
    rows = addition_rows("test", 4)
    module = GKDModule(student, teacher, tokenizer, lmbda=0.0, sampling={"max_new_tokens": 4})
    held_out = HeldOutEvaluation(max_new_tokens=4)
    fit(module, tokenizer, rows, tmp_path, held_out, max_steps=1)
    # two untrained tiny models: neither answers one sum right
    assert held_out.results["teacher"]["accuracy"] == held_out.results["before"]["accuracy"] == 0.0
    assert held_out.results["gap_closed"] == {"accuracy": None}
    assert json.loads((tmp_path / "held_out.json").read_text())["gap_closed"] == {"accuracy": None}
    metrics = logged(tmp_path)
    assert "test/accuracy_after" in metrics and "test/accuracy_gap_closed" not in metrics
    assert "gap closed n/a (the teacher does not score above the start)" in held_out.table(4)


def test_without_a_teacher_there_is_no_gap(student, tokenizer, tmp_path):
    from lightning_gkd import SFTModule

    rows = addition_rows("test", 4)
    held_out = HeldOutEvaluation(max_new_tokens=4)
    fit(SFTModule(student, tokenizer), tokenizer, rows, tmp_path, held_out, max_steps=1)
    assert set(held_out.results) == {"before", "after"}
    assert "gap closed" not in held_out.table(4)
    assert not any(key.endswith("_gap_closed") for key in logged(tmp_path))


@pytest.mark.slow
def test_a_run_resumed_after_ctrl_c_reports_its_own_start_as_before(tmp_path):
    """The default toy job (its shipped student, 24 test rows), Ctrl-C after step 10, then ckpt_path=last: the
    held-out "before" of the finished run is the shipped student's score, not the restored checkpoint's."""
    command = [
        sys.executable,
        "-m",
        "lightning_gkd.cli.train",
        "print_config=false",
        "paths.cache_dir=cache",
        "trainer.limit_val_batches=0",
        "callbacks.sample_table=null",
        "+data.test_data.num_rows=24",
        "optimizer.lr=3e-3",
        "method.lmbda=0.0",  # supervised steps: the student moves fast and the test stays short
    ]
    run_dir, log = tmp_path / "outputs" / "runs" / "a", tmp_path / "first_run.log"
    process = signal_after_first_checkpoint(
        [*command, f"hydra.run.dir={run_dir}", "trainer.max_steps=100000", "trainer.val_check_interval=10"],
        cwd=tmp_path,
        run_dir=run_dir,
        log=log,
        signum=signal.SIGINT,
        timeout=300,
    )
    assert process.returncode == 130, log.read_text()[-3000:]
    interrupted = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    step = interrupted["global_step"]
    assert not (run_dir / "held_out.json").exists()
    resumed = subprocess.run(
        [*command, f"hydra.run.dir={tmp_path}/outputs/runs/b", f"trainer.max_steps={step + 1}", "ckpt_path=last"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    rows = addition_rows("test", 24)
    start = evaluate_generations(load_causal_lm(asset_path("toy/student_init")), tokenizer, rows, max_new_tokens=8)
    at_interrupt = load_causal_lm(asset_path("toy/student_init"))
    at_interrupt.load_state_dict({k.removeprefix("model."): v for k, v in interrupted["state_dict"].items()})
    restored = evaluate_generations(at_interrupt, tokenizer, rows, max_new_tokens=8)
    assert restored["accuracy"] != start["accuracy"]  # scoring the restored model would report another start
    saved = json.loads((run_dir / "held_out.json").read_text())
    assert saved["before"]["accuracy"] == start["accuracy"]
    assert "'before' is the run's start, from the checkpoint" in resumed.stdout + resumed.stderr
    assert f"model before {start['accuracy']:.3f}" in resumed.stdout + resumed.stderr


def test_with_tools_the_gap_closed_is_of_the_scores_only(tmp_path):
    """An agent's held-out figures also count tool calls and failures per transcript: reported before and after,
    but a gap closed only for the scores (a call count has no better direction)."""
    from lightning_gkd.evaluation import exact_match
    from lightning_gkd.toy.tools import TOOLS, tool_rows

    tokenizer = load_tokenizer(asset_path("toy_tools/teacher"))
    module = GKDModule(
        load_causal_lm(asset_path("toy_tools/student_init")),
        load_causal_lm(asset_path("toy_tools/teacher")),
        tokenizer,
        lmbda=0.0,
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"], "max_tool_calling_iterations": 4},
        sampling={"max_new_tokens": 24},
    )
    held_out = HeldOutEvaluation(metrics={"success": exact_match, "accuracy": None}, max_new_tokens=24)
    rows = tool_rows("test", 8)
    data = ChatDataModule(
        tokenizer, tool_rows("train", 8), test_data=rows, batch_size=4, max_length=200, assistant_turns="all"
    )
    small_trainer(tmp_path, max_steps=1, callbacks=[held_out]).fit(module, datamodule=data)
    assert set(held_out.results["after"]) == {"success", "tool_calls", "tool_failures"}
    assert set(held_out.results["gap_closed"]) == {"success"}
    assert "success: teacher" in held_out.table(8) and "tool_calls" not in held_out.table(8)
