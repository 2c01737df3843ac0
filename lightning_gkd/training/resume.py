"""``ckpt_path=last``: find the checkpoint of the most recent earlier run to resume from."""

from __future__ import annotations

from pathlib import Path

from lightning_gkd.training.checkpoint_io import CheckpointError

LAST = "last"


def latest_run_checkpoint(runs_dir: str | Path, *, exclude: str | Path | None = None) -> Path:
    """``<run>/checkpoints/last.ckpt`` of the most recent run under ``runs_dir`` (the newest such file), skipping
    the run folder ``exclude`` (the current run). Raises ``CheckpointError`` naming the folder when none exists."""
    runs_dir = Path(runs_dir)
    skip = Path(exclude).resolve() if exclude is not None else None
    candidates = (
        [
            path
            for path in runs_dir.glob("*/checkpoints/last.ckpt")
            if path.is_file() and path.parents[1].resolve() != skip
        ]
        if runs_dir.is_dir()
        else []
    )
    if not candidates:
        raise CheckpointError(
            f"ckpt_path=last: no earlier run under {str(runs_dir)!r} has checkpoints/last.ckpt. "
            "Start without ckpt_path, or pass the checkpoint file: ckpt_path=<run>/checkpoints/"
            "<name>.ckpt."
        )
    return max(candidates, key=lambda path: (path.stat().st_mtime, str(path)))


def resolve_ckpt_path(value: str | None, output_dir: str | Path) -> str | None:
    """``ckpt_path`` as given, or for ``last`` the newest ``checkpoints/last.ckpt`` among the other runs in the
    folder holding this run's ``output_dir`` (``outputs/runs/`` by default)."""
    if value is None or str(value) != LAST:
        return value
    output_dir = Path(output_dir)
    return str(latest_run_checkpoint(output_dir.parent, exclude=output_dir))
