"""Shared fixtures: the project's tokenizer and tiny Qwen2 models built from a config in well under a second."""

from __future__ import annotations

import pytest
import torch

from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.data.toy import addition_rows
from lightning_gkd.models.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A multi-process test is a slow one: ``multiprocess`` implies ``slow`` (pyproject's markers)."""
    for item in items:
        if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tokenizer():
    return build_chatml_tokenizer()


@pytest.fixture()
def student(tokenizer) -> torch.nn.Module:
    return tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)


@pytest.fixture()
def teacher(tokenizer) -> torch.nn.Module:
    return tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)


@pytest.fixture(scope="session")
def toy_rows() -> dict[str, list[dict]]:
    return {"train": addition_rows("train", 64), "val": addition_rows("val", 16)}


@pytest.fixture()
def hub_reachable(monkeypatch):
    """For tests that fake ``from_pretrained`` with a hub id: the hub counts as reachable (no network is used)."""
    monkeypatch.setattr("lightning_gkd.models.loading.hub_reachable", lambda timeout=3.0: True)
