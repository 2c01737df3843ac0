"""scripts/cross_tokenizer_accuracy.py --fast: every row trains a few steps from the shipped student, the BPE
teacher's rows go through the cross-tokenizer step (its parts are timed) and the shared-tokenizer rows do not, and
the report is written, so docs/cross_tokenizer.md cannot rot."""

import importlib.util
import json
import sys

import pytest
from helpers.paths import SCRIPTS

pytestmark = pytest.mark.slow  # a script smoke run

SCRIPT = SCRIPTS / "cross_tokenizer_accuracy.py"


def load_script():
    spec = importlib.util.spec_from_file_location("cross_tokenizer_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_fast_mode_runs_every_row_and_times_only_the_cross_tokenizer_ones(tmp_path):
    script = load_script()
    assert script.main(["--fast", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cross_tokenizer.json").read_text())
    results = report["results"]
    assert list(results) == [label for label, *_ in script.ROWS] and len(results) == 15
    for label, _method, teacher, loss in script.ROWS:
        row = results[label]
        assert len(row["test_accuracy"]) == 1 and 0.0 <= row["test_accuracy"][0] <= 1.0
        assert row["step_seconds"][0] > 0
        parts = row["parts_seconds_per_step"]
        if loss is None:
            # the shared-tokenizer path never decodes, re-tokenizes or aligns
            assert not any(parts.get(name, 0.0) for name in ("student_completions", "teacher_batch"))
        else:
            assert teacher == "toy_bpe/teacher"
            assert all(parts[name] > 0 for name in script.TIMED), (label, parts)
    assert report["pairing"]["teacher_vocabulary"] > report["pairing"]["student_vocabulary"]
    assert report["teacher_accuracy"]["toy_bpe/teacher"] > report["student_start"]
    text = (tmp_path / "cross_tokenizer.md").read_text()
    assert "| On-policy GKD, BPE teacher, projected (the default) |" in text and "×" in text
    assert "re-tokenize for the teacher" in text
