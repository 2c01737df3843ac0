"""scripts/reproduce_gkd.py --fast: every method runs a few steps from the shipped student and the report is
written, so the full comparison cannot rot."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a script smoke run

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reproduce_gkd.py"


def load_script():
    spec = importlib.util.spec_from_file_location("reproduce_gkd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fast_mode_runs_every_method_and_writes_the_report(tmp_path):
    script = load_script()
    assert script.main(["--fast", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    names = [row["method"] for row in results["table"]]
    assert names == [m.name for m in script.METHODS] and len(names) == 8
    assert results["teacher_accuracy"] > results["student_start_accuracy"]
    for run in results["runs"]:
        assert run["curve"] and [step for step, _ in run["curve"]] == [3, 6]
        assert 0.0 <= run["test_accuracy"] <= 1.0
    report = (tmp_path / "results.md").read_text()
    assert "| GKD β=0.9 |" in report and "gap closed" in report
    assert (tmp_path / "gkd_accuracy.png").stat().st_size > 10_000
    # the report can be re-rendered from results.json alone, identically
    assert script.main(["--rerender", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == report


def test_chain_fast_mode_scores_every_method_per_position_and_against_compute(tmp_path):
    script = load_script()
    assert script.main(["--task", "chain", "--fast", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "results_chain.json").read_text())
    assert [m["name"] for m in saved["methods"]] == [m.name for m in script.CHAIN_METHODS]
    assert {"OPD", "GKD β=1", "SeqKD", "Supervised KD"} <= {m["name"] for m in saved["methods"]}
    runs = saved["runs"]
    assert {r["arm"] for r in runs} == {"full", "low-data"}
    assert len([r for r in runs if r["arm"] == "full"]) == len(script.CHAIN_METHODS)  # one seed, one rate
    low_data = {r["method"] for r in runs if r["arm"] == "low-data"}
    assert low_data == set(saved["args"]["low_data_methods"]) and {"SFT", "Supervised KD", "OPD"} < low_data
    assert len(low_data) in (3, 4)  # and the best on-policy method of the full arm (unless that is OPD)
    for run in runs:
        assert [step for step, _ in run["curve"]] == [3, 6] == [step for step, _, _ in run["compute"]]
        flops = [f for _, f, _ in run["compute"]]
        assert 0 < flops[0] < flops[1] and run["compute"][1][2] > 0
        assert len(run["first_errors"]) == len(run["first_errors_sampled"]) == 64
        assert 0.0 <= run["test_sampled_accuracy"] <= 1.0
        tokens = run["diagnostics"]
        # supervised runs never sample; SeqKD (the teacher), GKD λ=1 and OPD (the student) sample every step
        if run["method"] in ("SFT", "Supervised KD"):
            assert tokens["tokens_generated"] == 0
        elif not run["method"].startswith("Mixed"):
            assert tokens["tokens_generated"] > 0
        assert (tokens["tokens_teacher_scored"] == 0) == (run["method"] == "SFT")
    opd = next(r for r in runs if r["method"] == "OPD")
    assert "train_opd_reward" in opd["diagnostics"] and opd["diagnostics"]["train_opd_is_weight_mean"] > 0
    report = (tmp_path / "results.md").read_text()
    assert "| OPD |" in report and "Compute-matched" in report and "<!-- task:chain -->" in report
    for plot in ("chain_accuracy.png", "chain_error_position.png"):
        assert (tmp_path / plot).stat().st_size > 10_000
    assert script.main(["--task", "chain", "--rerender", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == report


def test_tools_fast_mode_runs_every_method_and_classifies_every_transcript(tmp_path):
    spec = importlib.util.spec_from_file_location("reproduce_tools", SCRIPT.parent / "reproduce_tools.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    assert script.main(["--fast", "--out", str(tmp_path), "--workers", "1"]) == 0
    saved = json.loads((tmp_path / "results_tools.json").read_text())
    assert [row["method"] for row in saved["table"]] == [m.name for m in script.METHODS]
    assert saved["teacher"]["success"] > saved["start"]["success"]
    for run in saved["runs"]:
        assert sum(run["outcomes"].values()) == pytest.approx(1.0)
        assert run["example"][0]["role"] == "user"
    report = (tmp_path / "results.md").read_text()
    assert "<!-- task:tools -->" in report and "| OPD with tools |" in report and "Best on-policy method" in report
