"""The caches the offline teacher's tests read: built once per session over the first rows of the toy training split
(the 2-process build is tests/helpers/cache_build_worker.py, with the same settings)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cache_build_worker import ROWS, settings
from helpers.teacher_cache import TEACHER, TRAINER, one_thread

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import load_frozen_causal_lm
from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.toy import addition_rows


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(TEACHER)


@pytest.fixture(scope="session")
def rows():
    return addition_rows("train")[:ROWS]


@pytest.fixture(scope="session")
def teacher():
    return load_frozen_causal_lm(TEACHER, role="teacher")


@pytest.fixture(scope="session")
def built(tmp_path_factory, tokenizer, rows) -> Path:
    """The one-shot, single-process build (k=20, 6 shards of 16 rows, batches of 8)."""
    path = tmp_path_factory.mktemp("one_shot") / "cache"
    with one_thread():
        report = build_teacher_cache(TEACHER, tokenizer, rows, path, trainer=TRAINER, **settings())
    assert report.built_shards == 6 and report.built_tokens == report.manifest["total_tokens"] > 0
    return path


@pytest.fixture(scope="session")
def hidden_built(tmp_path_factory, tokenizer, rows) -> Path:
    """The hidden-state build (float16) over the rows and shards of ``built``."""
    path = tmp_path_factory.mktemp("hidden") / "cache"
    report = build_teacher_cache(TEACHER, tokenizer, rows, path, trainer=TRAINER, signal="hidden", **settings())
    assert report.built_shards == 6 and report.built_tokens == report.manifest["total_tokens"] > 0
    return path
