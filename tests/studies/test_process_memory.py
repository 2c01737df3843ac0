"""lightning_gkd.studies.process_memory: this process's resident memory and age (Linux)."""

import mmap
import sys

import pytest

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
    block = mmap.mmap(-1, 64 * 2**20)  # fresh pages (an allocator's freed memory may already be resident)
    block.write(b"\x01" * len(block))  # every page touched
    assert peak_since_reset_mb() >= before + 60
    block.close()
    assert peak_rss_mb() >= peak_since_reset_mb() - 1


def test_the_process_is_older_than_zero():
    assert process_age() > 0
