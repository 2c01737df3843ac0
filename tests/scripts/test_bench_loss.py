"""scripts/bench_loss.py times the hidden-state loss against a floor measured in the same run and writes its page
(docs/benchmarks_loss.md holds the full run)."""

import json
import re
import subprocess
import sys

import pytest
from helpers.paths import ROOT

pytestmark = pytest.mark.slow  # a script smoke run


def test_tiny_run_reports_each_configuration_against_its_floor(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_loss.py"), "--tiny", "--reps", "1", "--out", str(tmp_path)],
        check=True,
        cwd=tmp_path,
    )
    saved = json.loads((tmp_path / "benchmarks_loss.json").read_text())
    rows = saved["rows"]
    configurations = {(r["teacher_dtype"], r["beta"]) for r in rows}
    assert configurations == {(d, b) for d in ("bfloat16", "float32") for b in (0, 0.5)}
    assert {r["chunk_size"] for r in rows} == {64, 512} and len(rows) == 8
    n, v = saved["shape"]["positions"], saved["shape"]["vocab"]
    for row in rows:
        parts = row["floor_parts_s"]
        assert set(parts) == {"student logits", "teacher logits", "hidden gradient", "weight gradient"}
        assert row["floor_products_s"] == pytest.approx(sum(parts.values()))
        logit_bytes = 4 if row["teacher_dtype"] == "float32" else 2
        elementwise = n * v * (4 + logit_bytes + 4) / (saved["copy_GBps"] * 1e9)
        assert row["floor_elementwise_s"] == pytest.approx(elementwise)
        assert row["floor_s"] == pytest.approx(row["floor_products_s"] + elementwise)
        assert row["ratio"] == pytest.approx(row["step_s"] / row["floor_s"])
        assert row["profile_s"]["products (mm, addmm)"] > 0 and row["profile_s"]["wall"] > 0
    page = (tmp_path / "benchmarks_loss.md").read_text()
    ratios = re.findall(r"\| (\d+\.\d\d)x \|$", page, flags=re.MULTILINE)
    assert page.startswith("# Benchmark: the hidden-state GKD loss")
    assert ratios == [f"{row['ratio']:.2f}" for row in rows]
