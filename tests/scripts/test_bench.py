"""scripts/bench.py runs end to end (TRL's GKDTrainer and DistillationTrainer and GKDModule, each in its own
process) and writes its report. Toy sizes: this checks the script, not speed (docs/benchmarks.md has the real run)."""

import json
import subprocess
import sys

import pytest
from helpers.paths import ROOT

pytestmark = pytest.mark.slow  # a script smoke run


def test_bench_runs_trl_and_ours_and_writes_the_table(tmp_path):
    out = tmp_path / "bench.md"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench.py"),
            "--tiny",
            "--reps",
            "1",
            "--steps",
            "4",
            "--warmup",
            "4",
            "--configs",
            "trl_no_gc",
            "trl_distill",
            "ours_k4",
            "--lmbdas",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    meta = results.pop("meta")[0]
    assert meta["reps"] == 1 and meta["steps"] == 4 and meta["command"].startswith("python scripts/bench.py --tiny")
    assert set(results) == {"trl_no_gc@1.0", "trl_distill@1.0", "ours_k4@1.0"}
    for runs in results.values():
        assert runs[0]["steps"] == 4 and runs[0]["seconds_per_step"] > 0 and runs[0]["peak_rss_mb"] > 0
    assert results["ours_k4@1.0"][0]["group"] == 4
    report = out.read_text()
    assert "| ours, steps_per_generation 4 | 1 |" in report and "vocabulary 512" in report
    assert "| TRL DistillationTrainer, defaults (bf16 off) | 1 |" in report


def test_real_shape_mode_reports_the_floor_the_decode_profile_and_each_lever(tmp_path):
    """--shape real (here with --tiny sizes): the side-by-side rows plus the floor from measured rates, the decode
    profile per matmul precision and the cumulative lever breakdown, all rendered."""
    out = tmp_path / "real.md"
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--tiny", "--shape", "real", "--reps", "1"]
    command += ["--steps", "4", "--warmup", "4", "--lmbdas", "1", "--out", str(out)]
    command += ["--configs", "ours", "ours_fp32", "ours_cli", "trl_distill"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert results.pop("meta")[0]["shape"] == "real"
    floor = results["floor"][0]
    assert set(floor["parts"]) == {"sample", "teacher forward", "student forward + backward", "optimizer"}
    assert all(value > 0 for value in floor["parts"].values()) and floor["rates"]["copy GB/s"] > 0
    assert set(results["decode"][0]) == {
        "highest@2",
        "highest@8",
        "medium@2",
        "medium@8",
        "bf16 weights@2",
        "bf16 weights@8",
    }
    levers = [key for key in results if key.startswith("levers:")]
    assert levers[0] == "levers:none" and len(levers) == 7
    assert all(sum(results[key][0].values()) > 0 for key in levers)
    report = out.read_text()
    assert "x TRL DistillationTrainer (issue 21's target: <= 0.6x)" in report and "x the floor below" in report
    assert "| + fused AdamW |" in report and "| + tied embedding's gradient as its rows (= our defaults) |" in report
    assert "| medium | 2 |" in report and "Qwen2.5-0.5B's shape" in report
    assert "| defaults + a bf16 sampling copy (opt-in) |" in report and "| bf16 weights | 2 |" in report
    # the ways in (issue 38): Python API, the command on folders, float32 against TRL, time to the first step
    cli = results["ours_cli@1.0"][0]
    assert cli["steps"] == 4 and cli["peak_rss_mb"] > cli["baseline_rss_mb"] > 0 and cli["first_step_seconds"] > 0
    assert results["ours@1.0"][0]["first_step_seconds"] > results["ours@1.0"][0]["models_seconds"] > 0
    assert "The ways in (lmbda 1): the Python API with its defaults" in report and "(target: <= 0.9x)" in report
    assert "| ours, the lightning-gkd command (models from folders) | 1 |" in report
    rendered = tmp_path / "again.md"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench.py"),
            "--render",
            str(out.with_suffix(".json")),
            "--out",
            str(rendered),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    assert rendered.read_text().split("\n", 3)[3] == report.split("\n", 3)[3]  # same report from the JSON
