"""docs/asynchronous.md is executable: its python block runs as shown (the shipped toy models, two optimizer steps,
the second batch sampled one step behind)."""

from __future__ import annotations

import re

from helpers.paths import DOCS

DOC = DOCS / "asynchronous.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def test_the_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [code for language, code in FENCE.findall(DOC.read_text()) if language == "python"]
    assert len(blocks) == 1
    namespace: dict = {"__name__": "docs_asynchronous"}
    exec(compile(blocks[0], f"{DOC.name}:block0", "exec"), namespace)
    metrics = namespace["trainer"].callback_metrics
    assert float(metrics["train/async/staleness"]) == 1.0
    assert float(metrics["train/async/staleness/1"]) == 1.0 and float(metrics["train/async/dropped"]) == 0.0
