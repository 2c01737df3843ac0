"""Shared fixtures: the project's tokenizer, tiny Qwen2 models built from a config in well under a second, and one
fitted run of the default toy job for the tests that only read what a run printed and wrote."""

from __future__ import annotations

import contextlib
import copy
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hydra_compose import compose_train

from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

# One intra-op thread for the tests run in this process, unless OMP_NUM_THREADS says otherwise (as the DDP, FSDP and
# cache workers and several test modules already do): while other processes hold the cores (a shared machine, the
# slow tier's subprocesses), two threads that wait for each other on every tiny op made the tests ~9x slower (2 busy
# cores: tests/methods/test_dpo.py, tests/ops/divergence/test_jsd.py and tests/data/test_loader.py, 327 tests, took
# 9.5 s with one thread and 89 s with two).
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


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


@dataclass(frozen=True)
class FittedRun:
    result: dict[str, Any]  # what lightning_gkd.cli.train.run returned
    run_dir: Path  # the run folder: logs/, tensorboard/, checkpoints/, student/, samples.jsonl
    stdout: str  # everything the run printed


#: `lightning-gkd experiment=debug` of the default toy job (4 steps, validation at steps 2 and 4) with CSV and
#: TensorBoard logs, 8 validation and 32 test rows
DEBUG_RUN = [
    "experiment=debug",
    "logger=[csv,tensorboard]",
    "+data.val_data.num_rows=8",
    "+data.test_data.num_rows=32",
]


@pytest.fixture(scope="session")
def _debug_run_once(tmp_path_factory) -> FittedRun:
    from lightning_gkd.cli.train import run

    tmp = tmp_path_factory.mktemp("debug_run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = run(compose_train(tmp, DEBUG_RUN))
    return FittedRun(result, tmp / "run", printed.getvalue())


@pytest.fixture()
def debug_run(_debug_run_once) -> FittedRun:
    """The session's one fit of DEBUG_RUN (its result a copy per test). Its folder is shared: read it, never write
    into it (copy what a test changes into its own tmp_path)."""
    return FittedRun(copy.deepcopy(_debug_run_once.result), _debug_run_once.run_dir, _debug_run_once.stdout)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    a fake server's forwards run in its request threads beside the client's, and with several intra-op threads each
    they spin against each other (and other processes) on a small CPU, 40x slower here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
