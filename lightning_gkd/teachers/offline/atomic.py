"""A file that is there whole or not at all: what the offline teacher writes survives a kill at any moment."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object], *, tmp_suffix: str = ".tmp") -> Path:
    """``write(tmp)`` the file to ``<path><tmp_suffix>``, flush it to disk, then rename it to ``path`` (an atomic
    replace). ``tmp_suffix``: unique per process where several processes write the same file at once."""
    tmp = path.with_name(path.name + tmp_suffix)
    write(tmp)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path
