"""docs/vision.md is executable: its python blocks run in order, in one namespace, in a temp folder (the shipped toy
vision models, two optimizer steps), so the Python example with a vision-language student runs as shown."""

from __future__ import annotations

import re

from helpers.paths import DOCS

DOC = DOCS / "vision.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def test_the_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [code for language, code in FENCE.findall(DOC.read_text()) if language == "python"]
    assert blocks, "the page shows the Python API with a vision-language student"
    namespace: dict = {"__name__": "docs_vision"}
    for index, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}:block{index}", "exec"), namespace)
    loss = float(namespace["trainer"].callback_metrics["train/loss"])
    assert loss == loss and loss >= 0  # finite: a GKD loss is a divergence
