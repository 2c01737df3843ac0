"""scripts/train_toy_teacher.py refuses what it cannot make (the tokenizer itself: tests/toy/test_bpe.py)."""

import subprocess
import sys

import pytest
from helpers.paths import SCRIPTS

pytestmark = pytest.mark.slow  # a script smoke run


def test_reuse_teacher_is_refused_with_the_bpe_tokenizer():
    command = [sys.executable, str(SCRIPTS / "train_toy_teacher.py"), "--tokenizer", "bpe", "--reuse-teacher"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--reuse-teacher remakes the student; --tokenizer bpe makes no student" in done.stderr
