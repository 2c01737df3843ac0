"""scripts/reproduce_gkd.py and scripts/reproduce_tools.py in their smoke modes (slow: script smoke runs): the studies'
sweeps run through `lightning-gkd -m` and their sections of results.md are written, so the full comparisons cannot
rot. What the tables compute from a sweep: tests/studies."""

import json

import pytest
from helpers.scripts import run_script

pytestmark = pytest.mark.slow


def test_addition_fast_mode_runs_the_study_sweep_and_writes_its_section(tmp_path):
    recipes = ["sft", "supervised_kd", "gkd_beta1"]
    run_script(
        "reproduce_gkd.py", "--task", "addition", "--fast", "--recipes", *recipes, "--out", str(tmp_path), cwd=tmp_path
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["task"] == "addition"
    assert [m["name"] for m in saved["methods"]] == ["SFT", "Supervised KD", "GKD β=1"]
    assert (
        saved["reference"]["teacher"]["greedy"]["accuracy"] > saved["reference"]["student_init"]["greedy"]["accuracy"]
    )
    assert saved["command"].startswith("lightning-gkd -m experiment=study_addition")
    for run in saved["runs"]:
        assert [step for step, _ in run["curve"]] == [3, 6] and 0.0 <= run["test_accuracy"] <= 1.0
    report = (tmp_path / "results.md").read_text()
    assert "| GKD β=1 |" in report and "gap closed" in report and "<!-- task:addition -->" in report
    assert (tmp_path / "gkd_accuracy.png").stat().st_size > 10_000
    sweep = tmp_path / ".sweeps" / "addition" / "sweep0"
    assert "| Supervised KD |" in (sweep / "study.md").read_text() and (sweep / "summary.md").exists()
    # the section is rendered from results.json alone, identically
    run_script("reproduce_gkd.py", "--rerender", "--out", str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "results.md").read_text() == report


def test_vlm_fast_mode_runs_the_toy_vision_study_and_writes_its_section(tmp_path):
    run_script("reproduce_gkd.py", "--task", "vlm", "--fast", "--out", str(tmp_path), cwd=tmp_path)
    saved = json.loads((tmp_path / "results_vlm.json").read_text())
    assert saved["task"] == "shapes"
    assert [m["name"] for m in saved["methods"]] == ["SFT", "Supervised KD", "GKD β=0"]
    assert (
        saved["reference"]["teacher"]["greedy"]["accuracy"] > saved["reference"]["student_init"]["greedy"]["accuracy"]
    )
    assert saved["command"].startswith("lightning-gkd -m experiment=study_vlm")
    report = (tmp_path / "results.md").read_text()
    assert "## Toy vision task" in report and "| GKD β=0 |" in report and "<!-- task:shapes -->" in report
    run_script("reproduce_gkd.py", "--rerender", "--out", str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "results.md").read_text() == report


def test_chain_fast_mode_scores_every_run_per_position_against_compute_and_a_served_teacher(tmp_path):
    recipes = ["supervised_kd", "gkd_beta1", "opd", "skd_k5", "opd_top1_server"]
    run_script(
        "reproduce_gkd.py", "--task", "chain", "--fast", "--recipes", *recipes, "--out", str(tmp_path), cwd=tmp_path
    )
    saved = json.loads((tmp_path / "results_chain.json").read_text())
    names = ["Supervised KD", "GKD β=1", "SKD K=5", "OPD", "OPD top-1 server"]  # in the study's sweeps' order
    assert [m["name"] for m in saved["methods"]] == names
    runs = saved["runs"]
    assert sorted(r["method"] for r in runs if r["arm"] == "full") == sorted(names)  # one seed, one rate
    low_data = {r["method"] for r in runs if r["arm"] == "low-data"}
    assert low_data == set(saved["args"]["low_data_methods"]) == {"Supervised KD", "GKD β=1", "OPD"}
    for run in runs:
        assert [step for step, _ in run["curve"]] == [3, 6] == [step for step, _, _ in run["compute"]]
        flops = [f for _, f, _ in run["compute"]]
        assert 0 < flops[0] < flops[1] and run["compute"][1][2] > 0
        assert len(run["first_errors"]) == len(run["first_errors_sampled"]) == 64
        assert 0.0 <= run["test_sampled_accuracy"] <= 1.0
        tokens = run["diagnostics"]
        # supervised KD never samples; GKD λ=1 and OPD (the student) sample every step; every method scores
        assert (tokens["tokens_generated"] == 0) == (run["method"] == "Supervised KD")
        assert tokens["tokens_teacher_scored"] > 0 and "guard_alerts" in tokens
    full = {r["method"]: r["diagnostics"] for r in runs if r["arm"] == "full"}
    assert "train_opd_reward" in full["OPD"] and full["OPD"]["train_opd_is_weight_mean"] > 0
    # speculative KD: the teacher's verification is counted, its replacement rate logged
    assert (
        full["SKD K=5"]["tokens_teacher_verified"] > 0 and 0 <= full["SKD K=5"]["train_sampler_replacement_rate"] <= 1
    )
    # the top-1 server arm trained against the served teacher, its parameters counted in the FLOPs as OPD's local one
    # (the teacher's 2 x params a token outweigh the student's 6 x params: without it, the ratio would be < 1/3)
    per_token = {name: full[name]["train_flops"] / full[name]["tokens_trained"] for name in ("OPD", "OPD top-1 server")}
    assert 0.5 < per_token["OPD top-1 server"] / per_token["OPD"] < 2
    assert "train_opd_reward" in full["OPD top-1 server"]
    reference = saved["reference"]
    assert len(reference["teacher"]["greedy"]["first_errors"]) == 64 and reference["student_init"]["val_accuracy"] >= 0
    report = (tmp_path / "results.md").read_text()
    assert "| OPD |" in report and "Compute-matched" in report and "<!-- task:chain -->" in report
    assert "### Speculative KD, stable OPD, a top-1 teacher" in report and "| SKD K=5 |" in report
    for plot in ("chain_accuracy.png", "chain_error_position.png"):
        assert (tmp_path / plot).stat().st_size > 10_000
    run_script("reproduce_gkd.py", "--rerender", "--out", str(tmp_path), cwd=tmp_path)
    assert (tmp_path / "results.md").read_text() == report


def test_tools_fast_mode_runs_every_method_and_classifies_every_transcript(tmp_path):
    run_script("reproduce_tools.py", "--fast", "--out", str(tmp_path), "--workers", "1", cwd=tmp_path)
    saved = json.loads((tmp_path / "results_tools.json").read_text())
    assert [row["method"] for row in saved["table"]] == [
        "SFT on teacher transcripts",
        "Supervised KD (λ=0)",
        "GKD with tools λ=1 β=0",
        "GKD with tools λ=1 β=1",
        "Mixed λ=0.5 β=0",
        "Mixed λ=0.5 β=0.5 (the default)",
        "OPD with tools",
        "SKD K=5 with tools λ=1 β=1",
    ]
    assert saved["teacher"]["success"] > saved["start"]["success"]
    for run in saved["runs"]:
        assert sum(run["outcomes"].values()) == pytest.approx(1.0)
        assert run["example"][0]["role"] == "user"
    report = (tmp_path / "results.md").read_text()
    assert "<!-- task:tools -->" in report and "| OPD with tools |" in report and "Best on-policy method" in report
