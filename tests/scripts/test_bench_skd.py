"""scripts/bench_skd.py runs end to end on the chain task's models and reports each sampler's cost against
``sampler=hf``'s in one run (docs/sampling.md quotes the full run)."""

import json
import subprocess
import sys

import pytest
from helpers.paths import ROOT

pytestmark = pytest.mark.slow  # a script smoke run


def test_fast_mode_times_every_sampler_for_both_students(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_skd.py"), "--fast", "--out", str(tmp_path)],
        check=True,
        cwd=tmp_path,
    )
    saved = json.loads((tmp_path / "benchmarks_skd.json").read_text())
    rows = saved["results"]
    assert len(rows) == 2 * 7 and {row["student"] for row in rows} == {"student_init", "teacher"}
    for row in rows:
        assert row["ms_per_token"] > 0 and row["sampled_tokens"] > 0
        if row["sampler"] == "hf":
            assert row["vs_hf"] == 1.0 and "replacement_rate" not in row
        else:
            assert 0 <= row["replacement_rate"] <= 1 and row["teacher_tokens_per_token"] > 0
    rate = {(r["student"], r["sampler"]): r["replacement_rate"] for r in rows if r["sampler"] != "hf"}
    # the teacher as its own student keeps more of its proposals than the shipped start
    assert rate["teacher", "skd K=5 n=1"] < rate["student_init", "skd K=5 n=1"]
