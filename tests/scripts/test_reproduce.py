"""scripts/reproduce_gkd.py --fast: every method runs a few steps from the shipped student and the report is
written, so the full comparison cannot rot (slow: script smoke runs); its tables' gap-closed column, from the
results the docs ship."""

import importlib.util
import json
import shutil
import statistics
import sys

import pytest
from helpers.paths import DOCS, SCRIPTS

SCRIPT = SCRIPTS / "reproduce_gkd.py"


def load_script():
    spec = importlib.util.spec_from_file_location("reproduce_gkd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_fast_mode_runs_every_method_and_writes_the_report(tmp_path):
    script = load_script()
    assert script.main(["--fast", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    names = [row["method"] for row in results["table"]]
    assert names == [m.name for m in script.METHODS] and len(names) == 11
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


@pytest.mark.slow
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
    # speculative KD: the teacher's verification is counted, its replacement rate logged
    skd = next(r for r in runs if r["method"] == "SKD K=5")["diagnostics"]
    assert skd["tokens_teacher_verified"] > 0 and 0 <= skd["train_sampler_replacement_rate"] <= 1
    # the top-1 server arms trained against the served teacher (its parameters counted in the FLOPs)
    served = next(r for r in runs if r["method"] == "OPD top-1 server")["diagnostics"]
    assert served["train_flops"] > 0 and "train_opd_reward" in served
    assert all("guard_alerts" in r["diagnostics"] for r in runs if r["arm"] == "full")
    report = (tmp_path / "results.md").read_text()
    assert "| OPD |" in report and "Compute-matched" in report and "<!-- task:chain -->" in report
    assert "### Speculative KD, stable OPD, a top-1 teacher" in report and "| SKD K=25 |" in report
    for plot in ("chain_accuracy.png", "chain_error_position.png"):
        assert (tmp_path / plot).stat().st_size > 10_000
    assert script.main(["--task", "chain", "--rerender", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == report


@pytest.mark.slow
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


def expected_gaps(accuracies, teacher, start):
    seeds = [(acc - start) / (teacher - start) for acc in accuracies]
    return seeds, statistics.fmean(seeds), statistics.stdev(seeds)


def test_the_chain_table_closes_the_gap_per_seed_from_the_saved_runs():
    """docs/results_chain.json, two of its methods: each seed's greedy test accuracy against the teacher's and the
    student start's greedy accuracy, then mean ± std, as the rendered row shows."""
    script = load_script()
    saved = json.loads((DOCS / "results_chain.json").read_text())
    keep = {"Supervised KD", "GKD β=1"}
    saved = {
        **saved,
        "methods": [m for m in saved["methods"] if m["name"] in keep],
        "runs": [r for r in saved["runs"] if r["method"] in keep],
    }
    teacher = saved["reference"]["teacher"]["greedy"]["accuracy"]
    start = saved["reference"]["student_init"]["greedy"]["accuracy"]
    assert (round(teacher, 3), round(start, 3)) == (0.980, 0.162)
    table = script.chain_table(saved)
    assert [row["method"] for row in table] == ["Supervised KD", "GKD β=1"]
    for row in table:
        accuracies = [r["test_accuracy"] for r in saved["runs"] if r["method"] == row["method"] and r["arm"] == "full"]
        seeds, mean, std = expected_gaps(accuracies, teacher, start)
        assert len(seeds) == 3 and row["gap_closed_seeds"] == pytest.approx(seeds, abs=1e-12)
        assert (row["gap_closed"], row["gap_closed_std"]) == pytest.approx((mean, std), abs=1e-12)
    lines = script.chain_lines(saved, table)
    assert any(line.startswith("| method | what | lr | test greedy | gap closed greedy |") for line in lines)
    (gkd,) = [line for line in lines if line.startswith("| GKD β=1 |")]
    assert "| 0.570 ± 0.006 (n=3) | 49.8% ± 0.8% |" in gkd


def test_the_addition_report_rerenders_the_gap_per_seed(tmp_path):
    """--rerender from docs/results.json alone: the gap-closed column is recomputed from each seed's test accuracy
    (mean ± std) and its per-seed values are written back to results.json."""
    script = load_script()
    shutil.copy(DOCS / "results.json", tmp_path / "results.json")
    assert script.main(["--rerender", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    teacher, start = saved["teacher_accuracy"], saved["student_start_accuracy"]
    report = (tmp_path / "results.md").read_text()
    for row in saved["table"]:
        accuracies = [r["test_accuracy"] for r in saved["runs"] if r["method"] == row["method"]]
        seeds, mean, std = expected_gaps(accuracies, teacher, start)
        assert row["gap_closed_seeds"] == pytest.approx(seeds, abs=1e-12) and len(seeds) == 5
        assert (row["gap_closed"], row["gap_closed_std"]) == pytest.approx((mean, std), abs=1e-12)
        assert f"(n=5) | {mean:.1%} ± {std:.1%} |" in report
    assert "| SFT | cross-entropy on ground-truth answers | 0.003 | 0.749 ± 0.014 (n=5) | 70.0% ± 1.9% |" in report


def test_without_a_gap_to_close_the_tables_say_n_a():
    script = load_script()
    fields = script.gap_fields([0.5, 0.6], teacher_acc=0.3, start_acc=0.3)
    assert fields == {"gap_closed": None, "gap_closed_std": None, "gap_closed_seeds": [None, None]}
    assert script.fmt_gap(fields["gap_closed"], fields["gap_closed_std"]) == "n/a"
    assert script.fmt_gap(0.5, 0.025) == "50.0% ± 2.5%"


def test_add_keeps_the_earlier_methods_and_replaces_the_rerun_ones():
    script = load_script()
    before = {
        "runs": [{"method": "A", "seed": 0}, {"method": "B", "seed": 0}],
        "sweep": [{"method": "A", "lr": 1}, {"method": "B", "lr": 1}],
        "methods": [{"name": "A"}, {"name": "B"}],
        "seconds": 10.0,
        "command": "first",
        "args": {"low_data_methods": ["A"], "steps": 300},
    }
    new = {
        "runs": [{"method": "B", "seed": 1}, {"method": "C", "seed": 0}],
        "sweep": [{"method": "B", "lr": 2}, {"method": "C", "lr": 2}],
        "methods": [{"name": "B"}, {"name": "C"}],
        "seconds": 5.0,
        "command": "second",
        "args": {"low_data_methods": [], "steps": 300},
    }
    merged = script.merged_study(before, new)
    assert merged["runs"] == [{"method": "A", "seed": 0}, {"method": "B", "seed": 1}, {"method": "C", "seed": 0}]
    assert [m["name"] for m in merged["methods"]] == ["A", "B", "C"] and merged["sweep"][1] == {"method": "B", "lr": 2}
    assert merged["seconds"] == 15.0 and merged["command"] == "first && second"
    assert merged["args"]["low_data_methods"] == ["A"]
