"""lightning-gkd-eval: a trained run's exported student and its checkpoint, evaluated without training, report what
the run reported; the loss it chooses; errors raised before any model loads."""

import json
import math
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from helpers.hydra_compose import compose_train

from lightning_gkd.cli.evaluate import run
from lightning_gkd.toy.tiny import asset_path
from lightning_gkd.training.checkpoint_io import CheckpointError

ROWS = ["+data.val_data.num_rows=8", "+data.test_data.num_rows=32"]  # the rows of conftest.DEBUG_RUN


def compose_eval(tmp_path: Path, overrides: list[str]):
    """conf/evaluate.yaml composed as ``lightning-gkd-eval`` would, writing to tmp_path/eval."""
    return compose_train(tmp_path, overrides, config="evaluate", run_dir="eval")


@pytest.fixture()
def trained(debug_run):
    """A 4-step GKD run of the default toy job (conftest.debug_run): its result (held-out scores, exported student)
    and run folder."""
    return debug_run.result, debug_run.run_dir


def test_the_exported_student_scores_what_the_run_printed_for_student_after(trained, tmp_path):
    result, run_dir = trained
    out = run(compose_eval(tmp_path, [*ROWS, f"eval.model={result['student_dir']}"]))
    assert out["kind"] == "folder" and out["method"] == "GKDModule" and out["loss"] == "method"
    assert out["tokenizer"] == result["student_dir"]  # the folder's own tokenizer
    metrics = out["metrics"]
    assert metrics["test/accuracy"] == result["held_out"]["after"]["accuracy"]  # the same greedy decoding
    assert metrics["val/accuracy"] == pytest.approx(result["metrics"]["val/accuracy"])
    assert metrics["val/loss"] == pytest.approx(result["metrics"]["val/loss"], abs=1e-6)  # GKD's, against the teacher
    assert metrics["val/perplexity"] == pytest.approx(torch.tensor(metrics["val/cross_entropy"]).exp().item())
    assert out["num_rows"] == {"val": 8, "test": 32}
    # a multirun summary's columns: the score and, against the run's own held_out.json (eval.reference=auto: the
    # folder above student/), the share of its teacher-student gap closed: what the run reported
    assert out["held_out"] == {
        "eval": {"accuracy": metrics["test/accuracy"]},
        "gap_closed": {"accuracy": pytest.approx(result["held_out"]["gap_closed"]["accuracy"])},
    }
    held_out = result["held_out"]
    gap = (metrics["test/accuracy"] - held_out["before"]["accuracy"]) / (
        held_out["teacher"]["accuracy"] - held_out["before"]["accuracy"]
    )
    assert metrics["test/accuracy_gap_closed"] == pytest.approx(gap, abs=1e-12)
    assert out["gap_closed"]["reference"] == str((run_dir / "held_out.json").resolve())
    assert out["gap_closed"]["teacher"] == held_out["teacher"] and out["gap_closed"]["before"] == held_out["before"]
    written = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert written["metrics"] == metrics
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [s["split"] for s in samples] == ["val"] * 8 + ["test"] * 32
    test = [s for s in samples if s["split"] == "test"]
    assert sum(s["scores"]["accuracy"] for s in test) / 32 == metrics["test/accuracy"]
    first = test[0]
    assert first["prompt"][-1]["role"] == "user" and first["prompt"][-1]["content"].endswith("=")
    assert first["scores"]["accuracy"] == float(first["completion"].strip() == first["reference"].strip())


def test_the_last_checkpoint_scores_as_the_exported_student(trained, tmp_path):
    result, run_dir = trained
    out = run(compose_eval(tmp_path, [*ROWS, f"eval.model={run_dir / 'checkpoints' / 'last.ckpt'}"]))
    assert out["kind"] == "checkpoint"
    assert out["metrics"]["test/accuracy"] == result["held_out"]["after"]["accuracy"]
    assert out["gap_closed"]["reference"] == str((run_dir / "held_out.json").resolve())  # the folder above checkpoints/
    exported = run(compose_eval(tmp_path, [*ROWS, f"eval.model={result['student_dir']}", "eval.loss=cross_entropy"]))
    untrained = run(compose_eval(tmp_path, [*ROWS, "eval.loss=cross_entropy"]))  # model.student as configured
    assert untrained["kind"] == "config" and untrained["gap_closed"] is None  # no run folder to look in
    assert out["metrics"]["val/cross_entropy"] == pytest.approx(exported["metrics"]["val/cross_entropy"], abs=1e-6)
    assert abs(out["metrics"]["val/cross_entropy"] - untrained["metrics"]["val/cross_entropy"]) > 1e-3


def test_without_a_teacher_the_loss_is_the_cross_entropy_sft_reports(tmp_path):
    teacher, rows = asset_path("toy/teacher"), ["+data.val_data.num_rows=8", "+data.test_data.num_rows=16"]
    out = run(compose_eval(tmp_path, [*rows, f"eval.model={teacher}", "model.teacher=null"]))
    assert out["loss"] == "cross_entropy" and "no teacher configured" in out["loss_reason"]
    assert out["method"] == "SFTModule" and "val/loss" not in out["metrics"]
    assert out["metrics"]["test/accuracy"] >= 0.9  # the toy teacher: 97.9% on the whole test split
    sft = run(compose_eval(tmp_path, [*rows, f"eval.model={teacher}", "method=sft", "eval.loss=method"]))
    assert sft["metrics"]["val/loss"] == pytest.approx(out["metrics"]["val/cross_entropy"])
    assert sft["metrics"]["val/cross_entropy"] == sft["metrics"]["val/loss"]
    assert sft["metrics"]["test/accuracy"] == out["metrics"]["test/accuracy"]
    none = run(
        compose_eval(tmp_path, [*rows, f"eval.model={teacher}", "eval.loss=none", "method.validation.metrics=null"])
    )
    assert none["metrics"] == {} and (tmp_path / "eval" / "samples.jsonl").read_text() == ""


def test_dpo_reports_its_preference_loss_and_rewards(tmp_path):
    """The policy is its own reference (method.reference: ${model.student} follows eval.model): the loss is ln 2."""
    overrides = ["method=dpo", f"eval.model={asset_path('toy/teacher')}", "+metrics=exact_match"]
    out = run(compose_eval(tmp_path, [*overrides, "+data.val_data.num_rows=8"]))
    assert out["method"] == "DPOModule" and out["loss"] == "method"
    assert out["metrics"]["val/loss"] == pytest.approx(math.log(2)) and out["metrics"]["val/rewards/margins"] == 0
    assert out["metrics"]["val/exact_match"] >= 7 / 8  # the method's own greedy validation metric
    assert "val/cross_entropy" not in out["metrics"] and out["samples"] == 0  # preference rows: no chat samples


def _no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr("lightning_gkd.models.loading.AutoModelForCausalLM.from_pretrained", refuse)


def test_a_checkpoint_of_another_student_is_refused_before_any_model_loads(trained, tmp_path, monkeypatch):
    _, run_dir = trained
    other_run = tmp_path / "other_run"
    (other_run / "checkpoints").mkdir(parents=True)
    (other_run / ".hydra").mkdir()
    (other_run / ".hydra" / "overrides.yaml").write_text("- method.lmbda=1.0\n")
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", other_run / "checkpoints" / "last.ckpt")
    _no_model_loads(monkeypatch)
    overrides = [
        f"eval.model={other_run / 'checkpoints' / 'last.ckpt'}",
        f"model.student.name_or_path={asset_path('toy/teacher')}",
    ]
    with pytest.raises(ValueError, match="does not fit model.student") as error:
        run(compose_eval(tmp_path, overrides))
    message = str(error.value)
    assert "27 weights have other shapes (model.lm_head.weight: checkpoint (259, 64), model (259, 128);" in message
    assert "24 of the model's weights are not in it (model.model.layers.2." in message
    assert "started with: method.lmbda=1.0" in message


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            ["eval.model=outputs/no_such_run/student"],
            FileNotFoundError,
            "eval.model: 'outputs/no_such_run/student' does not exist",
        ),
        (["eval.model=no_such_run/last.ckpt"], CheckpointError, "does not exist"),
        (["ckpt_path=x.ckpt"], ValueError, "to evaluate a checkpoint pass eval.model=x.ckpt"),
        (["trainer.devices=2"], ValueError, "runs in one process: got trainer.devices=2"),
        (["eval.loss=kl"], ValueError, "eval.loss must be one of auto, method, cross_entropy, none"),
        (
            ["eval.reference=no_such_run/held_out.json"],
            FileNotFoundError,
            "eval.reference='no_such_run/held_out.json': no",
        ),
    ],
)
def test_settings_errors_before_any_model_loads(tmp_path, monkeypatch, overrides, error, match):
    _no_model_loads(monkeypatch)
    with pytest.raises(error, match=match):
        run(compose_eval(tmp_path, overrides))


def test_the_gap_is_measured_against_a_named_run_and_only_on_the_same_test_rows(trained, tmp_path):
    """model.student as configured is the run's start: against that run's held_out.json it closed none of the gap.
    With other test rows (eval.max_rows) the two cannot be compared, and eval.json says why."""
    result, run_dir = trained
    start = run(compose_eval(tmp_path, [*ROWS, "eval.loss=none", f"eval.reference={run_dir}"]))
    assert start["metrics"]["test/accuracy"] == result["held_out"]["before"]["accuracy"]
    assert start["metrics"]["test/accuracy_gap_closed"] == 0.0
    assert start["held_out"]["gap_closed"] == {"accuracy": 0.0}
    fewer = [*ROWS, "eval.loss=none", f"eval.model={result['student_dir']}", "eval.max_rows=8"]
    out = run(compose_eval(tmp_path, fewer))
    assert out["gap_closed"]["why"] == "it scored 32 test rows, this evaluation 8"
    assert "test/accuracy_gap_closed" not in out["metrics"] and "gap_closed" not in out["held_out"]
    none = run(
        compose_eval(tmp_path, [*ROWS, "eval.loss=none", f"eval.model={result['student_dir']}", "eval.reference=null"])
    )
    assert none["gap_closed"] is None and "test/accuracy_gap_closed" not in none["metrics"]


def test_a_run_folder_points_at_its_exported_student(trained, tmp_path, monkeypatch):
    _, run_dir = trained
    _no_model_loads(monkeypatch)
    with pytest.raises(FileNotFoundError, match=f"its exported model is {run_dir / 'student'}"):
        run(compose_eval(tmp_path, [f"eval.model={run_dir}"]))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="is not a checkpoint of a lightning-gkd run"):
        run(compose_eval(tmp_path, [f"eval.model={tmp_path / 'plain.ckpt'}"]))


@pytest.mark.slow
def test_the_console_script_writes_to_outputs_eval(trained, tmp_path):
    result, _ = trained
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "lightning-gkd-eval"]
    assert script.value == "lightning_gkd.cli.evaluate:main"
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "lightning-gkd-eval"),
            f"eval.model={result['student_dir']}",
            "eval.loss=none",
            "+data.val_data.num_rows=4",
            "+data.test_data.num_rows=4",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = (tmp_path / "outputs" / "eval").glob("*/eval.json")
    assert json.loads(written.read_text())["num_rows"] == {"val": 4, "test": 4}
    assert "== lightning_gkd evaluation ==" in done.stdout and "test/accuracy: " in done.stdout


def test_with_tools_the_teacher_is_scored_on_greedy_rollouts_with_them(tmp_path):
    """experiment=toy_tools: the method's tools roll every prompt out; the final answers are scored and each
    sample keeps its transcript."""
    teacher = asset_path("toy_tools/teacher")
    rows = ["+data.val_data.num_rows=8", "+data.test_data.num_rows=16", "eval.max_rows=16"]
    out = run(compose_eval(tmp_path, ["experiment=toy_tools", *rows, f"eval.model={teacher}"]))
    assert out["metrics"]["test/success"] >= 0.9  # the shipped teacher (see assets/toy_tools/manifest.json)
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    transcript = samples[-1]["transcript"]
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool"] * 1 + ["assistant", "tool"] * 2 + [
        "assistant"
    ]
    assert transcript[-1]["content"] == samples[-1]["completion"]
    # the prompt is what the agent was given (the question), not the reference transcript's calls and results
    assert [m["role"] for m in samples[-1]["prompt"]] == ["user"] and samples[-1]["prompt"] == transcript[:1]
    assert "test/accuracy" not in out["metrics"]  # one name per figure: success
