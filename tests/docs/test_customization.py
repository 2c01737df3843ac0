"""docs/customization.md is executable: each section's python blocks run (after the setup block) in a temp folder,
and each `lightning-gkd` command line composes with Hydra and names importable `_target_`s."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from helpers.paths import DOCS
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_object
from omegaconf import OmegaConf

from lightning_gkd.toy.tiny import write_tiny_models

DOC = DOCS / "customization.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
REQUIRED = [
    "Optimizer and learning-rate scheduler",
    "A quantized reference or teacher (8-bit / 4-bit)",
    "Callbacks",
    "Evaluation metrics",
    "Mixed precision and gradient accumulation",
    "A new objective by subclassing",
    "A new distillation objective (GKD)",
    "A distillation loss object (GKD)",
    "A custom batch format",
]


def sections() -> dict[str, list[tuple[str, str]]]:
    """Section title -> its fenced blocks as (language, code)."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.M)
    return {title.strip(): FENCE.findall(body) for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def command_overrides(code: str) -> list[list[str]]:
    return [shlex.split(line)[1:] for line in code.splitlines() if line.startswith("lightning-gkd")]


def targets(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return found + [t for value in node.values() for t in targets(value)]
    if isinstance(node, list):
        return [t for value in node for t in targets(value)]
    return []


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    return write_tiny_models(tmp_path_factory.mktemp("docs-cache") / "tiny-v1")


@pytest.fixture()
def doc_dir(tmp_path, tiny_assets, monkeypatch):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tiny-v1").symlink_to(tiny_assets, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules_before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - modules_before:  # the page's own files (my_dpo, ...) must not leak
        module_file = getattr(sys.modules[name], "__file__", None) or ""
        if module_file.startswith(str(tmp_path)):
            del sys.modules[name]


def test_the_page_covers_every_customization():
    found = sections()
    assert "Setup" in found and all(title in found for title in REQUIRED), sorted(found)
    for title in REQUIRED:
        languages = [language for language, _ in found[title]]
        assert "python" in languages and "bash" in languages, title


@pytest.mark.parametrize("title", REQUIRED)
def test_section_runs(title, doc_dir):
    blocks = sections()
    namespace: dict = {"__name__": "docs_" + re.sub(r"\W+", "_", title)}
    for code in (code for language, code in blocks["Setup"] if language == "python"):
        exec(compile(code, f"{DOC.name}:Setup", "exec"), namespace)
    files = [(lang, code) for lang, code in blocks[title] if lang == "python" and code.startswith("# file: ")]
    for _, code in files:
        name = code.splitlines()[0].removeprefix("# file: ").strip()
        (doc_dir / name).write_text(code)

    commands = [overrides for lang, code in blocks[title] if lang == "bash" for overrides in command_overrides(code)]
    assert commands, f"{title}: no lightning-gkd command line"
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        for overrides in commands:
            cfg = compose("train", overrides=overrides)
            for target in targets(OmegaConf.to_container(cfg, resolve=False)):
                assert get_object(target) is not None, (overrides, target)
    GlobalHydra.instance().clear()

    for index, (language, code) in enumerate(blocks[title]):
        if language == "python" and not code.startswith("# file: "):
            exec(compile(code, f"{DOC.name}:{title}:{index}", "exec"), namespace)
    assert os.getcwd() == str(doc_dir)
