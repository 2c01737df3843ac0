"""The teacher scripts run end to end in their smoke modes and write their reports (the documented runs are in
docs/sparse_teacher.md, docs/multi_teacher.md and docs/benchmarks_teachers.md): scripts/sparse_teacher_accuracy.py,
scripts/multi_teacher_skills.py and scripts/bench_teachers.py (toy sizes at vocabularies 512 and 1024; without vLLM
its server rows are left out)."""

import importlib.util
import json
import subprocess
import sys

import pytest
from helpers.paths import ROOT
from helpers.scripts import run_script

pytestmark = pytest.mark.slow  # a script smoke run


def test_sparse_teacher_accuracy_fast_mode_writes_its_table(tmp_path):
    run_script("sparse_teacher_accuracy.py", "--fast", "--ks", "1", "259", "--out", str(tmp_path), cwd=tmp_path)
    report = json.loads((tmp_path / "sparse_teacher.json").read_text())
    assert list(report["results"]) == ["dense (in-process)", "cache k=1", "cache k=259"]
    assert report["cache"]["k"] == 259 and report["cache"]["num_rows"] == 256 + 32
    assert "| cache k=1 |" in (tmp_path / "sparse_teacher.md").read_text()


def test_multi_teacher_skills_fast_mode_routes_both_skills(tmp_path):
    run_script("multi_teacher_skills.py", "--fast", "--out", str(tmp_path), cwd=tmp_path)
    report = json.loads((tmp_path / "multi_teacher.json").read_text())
    assert list(report["arms"]) == ["routed (multi)", '"add" teacher only', '"reverse" teacher only']
    counts = report["token_counts"]["seed 0"]
    assert counts["train/teacher/add/tokens"] > 0 and counts["train/teacher/reverse/tokens"] > 0


def test_bench_teachers_runs_each_kind_in_its_own_process_at_two_vocabularies(tmp_path):
    out = tmp_path / "bt.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_teachers.py"), "--tiny", "--reps", "1", "--steps", "2"]
        + ["--warmup", "1", "--large-steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    served = importlib.util.find_spec("vllm") is not None
    kinds = {"local@0", "cache@0", "cache_hidden@0", "local@1"} | (
        {"server@0", "server_hidden@0", "server@1", "server_hidden@1"} if served else set()
    )
    assert [p["vocab"] for p in results["passes"]] == [512, 1024]  # --tiny: the toy vocabulary, then a larger one
    for result in results["passes"]:
        assert set(result["runs"]) == kinds and not result["failures"]
        local, hidden = result["runs"]["local@0"][0], result["runs"]["cache_hidden@0"][0]
        assert local["seconds_per_step"] > 0 and hidden["peak_rss_mb"] >= hidden["setup_peak_rss_mb"] > 0
        head_mb = result["vocab"] * 64 * 4 / 2**20  # --tiny's teacher: H = 64, float32
        assert hidden["teacher_mb"] == pytest.approx(head_mb) and result["runs"]["cache@0"][0]["teacher_mb"] == 0
        # the hidden-state cache gives the dense loss up to float16 rounding
        assert max(result["losses"]["relative_difference"]["cache hidden (float16)"].values()) < 1e-3
        assert result["caches"]["cache_hidden"]["bytes_per_token"] > 2 * 64  # 2H a token plus offsets
    text = out.read_text()
    assert "## Vocabulary 512" in text and "## Vocabulary 1024" in text
    assert "| cache hidden (float16) | 0 |" in text and "| full float32 logits | 4,096 |" in text
