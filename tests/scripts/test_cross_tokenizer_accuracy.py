"""scripts/cross_tokenizer_accuracy.py --fast: every row trains a few steps from the shipped student, the BPE
teacher's rows go through the cross-tokenizer step (its parts are timed) and the shared-tokenizer rows do not, and
the report is written, so docs/cross_tokenizer.md cannot rot."""

import json

import pytest
from helpers.scripts import run_script

pytestmark = pytest.mark.slow  # a script smoke run

#: the functions the script times inside the cross-tokenizer loss
TIMED = ("student_completions", "teacher_batch", "hidden_states_and_head", "cross_tokenizer_row_terms")


def test_fast_mode_runs_every_row_and_times_only_the_cross_tokenizer_ones(tmp_path):
    run_script("cross_tokenizer_accuracy.py", "--fast", "--out", str(tmp_path), cwd=tmp_path)
    report = json.loads((tmp_path / "cross_tokenizer.json").read_text())
    results = report["results"]
    assert len(results) == 15 and next(iter(results)) == "SFT (no teacher)"
    for label, row in results.items():
        assert len(row["test_accuracy"]) == 1 and 0.0 <= row["test_accuracy"][0] <= 1.0
        assert row["step_seconds"][0] > 0
        parts = row["parts_seconds_per_step"]
        if "BPE teacher" not in label:
            # the shared-tokenizer path never decodes, re-tokenizes or aligns
            assert row["teacher"] != "toy_bpe/teacher"
            assert not any(parts.get(name, 0.0) for name in ("student_completions", "teacher_batch"))
        else:
            assert row["teacher"] == "toy_bpe/teacher" and row["loss"].endswith(("kept", "skipped"))
            assert all(parts[name] > 0 for name in TIMED), (label, parts)
    assert report["pairing"]["teacher_vocabulary"] > report["pairing"]["student_vocabulary"]
    assert report["teacher_accuracy"]["toy_bpe/teacher"] > report["student_start"]
    text = (tmp_path / "cross_tokenizer.md").read_text()
    assert "| On-policy GKD, BPE teacher, projected (the default) |" in text and "×" in text
    assert "re-tokenize for the teacher" in text
