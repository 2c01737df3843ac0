"""docs/python_api.md is executable: its python blocks run in order, in one namespace, in a temp folder (the shipped
toy models, a few optimizer steps each), so every call it shows exists with the arguments it shows."""

from __future__ import annotations

import re

from helpers.paths import DOCS

DOC = DOCS / "python_api.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def test_the_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [code for language, code in FENCE.findall(DOC.read_text()) if language == "python"]
    assert len(blocks) >= 5, "the setup block and one per method"
    namespace: dict = {"__name__": "docs_python_api"}
    for index, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}:block{index}", "exec"), namespace)
    assert (tmp_path / "my-student" / "config.json").is_file()  # module.export("my-student")
