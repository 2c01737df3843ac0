"""lightning_gkd.studies.process_memory: this process's resident memory and age (Linux)."""

import sys

import pytest
import torch

from lightning_gkd.studies.process_memory import (
    current_rss_mb,
    peak_rss_mb,
    peak_since_reset_mb,
    process_age,
    reset_peak_rss,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_peak_since_a_reset_counts_what_was_allocated_after_it():
    reset_peak_rss()
    before = current_rss_mb()
    block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
    assert peak_since_reset_mb() >= before + 60
    del block
    assert peak_rss_mb() >= peak_since_reset_mb() - 1


def test_the_process_is_older_than_zero():
    assert process_age() > 0
