"""Running a script of scripts/ as its users do: a fresh process, from a folder of the test's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.paths import SCRIPTS


def run_script(name: str, *args: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """``python scripts/<name> <args>`` in ``cwd``; fails the test with the end of its output unless it exits 0."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done
