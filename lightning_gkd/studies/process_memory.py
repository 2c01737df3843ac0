"""This process's memory and age (Linux ``/proc``; the benchmarks' peak-memory columns)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def peak_rss_mb() -> float:
    """The peak resident set size of this process so far, MB (``getrusage``: Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def children_peak_rss_mb() -> float:
    """The largest peak resident set size of the child processes waited for, MB."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def current_rss_mb() -> float:
    """The resident set size now, MB (``VmRSS``)."""
    return _status_mb("VmRSS")


def reset_peak_rss() -> None:
    """Restart the peak count (``VmHWM``) at the current resident set, so what came before (imports, models every
    measurement builds alike) does not hide the peak of what is measured (Linux: ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_since_reset_mb() -> float:
    """The peak resident set size since ``reset_peak_rss``, MB (``VmHWM``)."""
    return _status_mb("VmHWM")


def process_age() -> float:
    """Seconds since this process started (0 where /proc cannot be read)."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def process_start() -> float:
    """This process's start on the ``time.perf_counter`` clock (interpreter start included)."""
    return time.perf_counter() - process_age()
