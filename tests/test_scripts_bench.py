"""scripts/bench.py runs end to end (TRL's GKDTrainer and DistillationTrainer and GKDModule, each in its own
process) and writes its report. Toy sizes: this checks the script, not speed (docs/benchmarks.md has the real run)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
