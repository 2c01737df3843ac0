"""Resuming a run: ``ckpt_path=last`` (the newest earlier run, checked against its record), an explicit checkpoint,
and continuing in the checkpoint's own run folder.

- ``ckpt_path=last`` takes ``checkpoints/last.ckpt`` of the newest other run beside this one (``outputs/runs/``) and
  refuses it, naming the run and what differs, when its record (``run.json``, see ``run_record``) says it finished
  with the same ``trainer.max_steps`` or more, is already past the new ``trainer.max_steps``, or was trained with a
  different config. A run without a record (made before runs were recorded) is resumed with a warning.
- ``ckpt_path=<file>`` is trusted: the same findings are warnings.
- A checkpoint inside a run folder (``<run>/checkpoints/*.ckpt``, ``<run>/hpc_ckpt_*.ckpt``) resumes *into* that
  folder: ``paths.output_dir`` becomes ``<run>``, so logs (``metrics.csv`` continues), checkpoints, samples, held-out
  scores and the export stay together. The folder Hydra made for this launch is moved to ``<run>/resumes/<name>/``
  when the run ends normally (``fold_launch_folder``).
"""

from __future__ import annotations

import csv
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig, open_dict

from lightning_gkd.training.checkpoint_io import CheckpointError, require_checkpoint
from lightning_gkd.training.run_record import (
    MISSING,
    RECORD,
    RunRecord,
    config_diff,
    is_rank_zero,
    override_value,
    read_record,
    restoring_override,
    training_config,
)

LAST = "last"
MAX_LISTED = 12


def _checkpoints(runs_dir: Path, exclude: Path | None) -> list[Path]:
    """``<run>/checkpoints/last.ckpt`` of every run under ``runs_dir`` but ``exclude``, newest first."""
    skip = exclude.resolve() if exclude is not None else None
    found = (
        [p for p in runs_dir.glob("*/checkpoints/last.ckpt") if p.is_file() and p.parents[1].resolve() != skip]
        if runs_dir.is_dir()
        else []
    )
    return sorted(found, key=lambda path: (path.stat().st_mtime, str(path)), reverse=True)


def latest_run_checkpoint(runs_dir: str | Path, *, exclude: str | Path | None = None) -> Path:
    """``<run>/checkpoints/last.ckpt`` of the most recent run under ``runs_dir`` (the newest such file), skipping
    the run folder ``exclude`` (the current run). Raises ``CheckpointError`` naming the folder when none exists."""
    candidates = _checkpoints(Path(runs_dir), Path(exclude) if exclude is not None else None)
    if not candidates:
        raise _no_earlier_run(runs_dir)
    return candidates[0]


def _no_earlier_run(runs_dir: str | Path) -> CheckpointError:
    return CheckpointError(
        f"ckpt_path=last: no earlier run under {str(runs_dir)!r} has checkpoints/last.ckpt. "
        "Start without ckpt_path, or pass the checkpoint file: ckpt_path=<run>/checkpoints/<name>.ckpt."
    )


def run_folder(ckpt_path: str | Path) -> Path | None:
    """The run folder holding a checkpoint (``<run>/checkpoints/x.ckpt`` or Lightning's ``<run>/hpc_ckpt_n.ckpt``),
    or None when the file is not in one (a run folder has a ``run.json`` or Hydra's ``.hydra/``)."""
    path = Path(ckpt_path)
    if "://" in str(ckpt_path):
        return None
    folder = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    if path.parent.name != "checkpoints" and not path.name.startswith("hpc_ckpt_"):
        return None
    return folder if (folder / RECORD).is_file() or (folder / ".hydra").is_dir() else None


def _steps(value: Any) -> int | None:
    return None if value is None or int(value) < 0 else int(value)  # -1: no step limit


def resume_findings(record: dict[str, Any], config: dict[str, Any], max_steps: int | None) -> list[str]:
    """Why resuming the run of ``record`` with this ``config`` and ``trainer.max_steps`` would be wrong; empty when
    it is a plain continuation (an unfinished run, same config) or an extension (finished, now more steps)."""
    findings = []
    old_max, step = _steps(record.get("max_steps")), int(record.get("global_step") or 0)
    new_max = _steps(max_steps)
    if record.get("finished") and (new_max is not None and (old_max is None or new_max <= old_max)):
        findings.append(
            f"it finished (step {step} of trainer.max_steps={record.get('max_steps')}), so it would train 0 steps and "
            f"export again; to train it further, raise trainer.max_steps above {record.get('max_steps')}"
        )
    elif new_max is not None and step >= new_max:
        findings.append(
            f"it is at step {step}, at or past trainer.max_steps={max_steps}; to train it further, raise "
            f"trainer.max_steps above {step}"
        )
    if record.get("config") is not None:
        diff = config_diff(record["config"], config)
        if diff:
            lines = [f"    {key}: {_shown(old)} -> {_shown(new)}" for key, old, new in diff]
            more = f"\n    ... and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else ""
            restore = " ".join(restoring_override(key, old, new) for key, old, new in diff[:MAX_LISTED])
            findings.append(
                "its config differs from this one (old -> new):\n"
                + "\n".join(lines[:MAX_LISTED])
                + more
                + f"\n  to resume it as it was, restore its values: {restore}"
            )
    return findings


def _shown(value: Any) -> str:
    return "(absent)" if value is MISSING else override_value(value)


def _matching_older(candidates: list[Path], config: dict[str, Any], max_steps: int | None) -> Path | None:
    for ckpt in candidates:
        record = read_record(ckpt.parents[1])
        if record is not None and not resume_findings(record, config, max_steps):
            return ckpt
    return None


def plan_resume(cfg: DictConfig) -> tuple[str | None, RunRecord]:
    """Resolve ``cfg.ckpt_path`` (``last``: the newest earlier run, checked against its record; a path: checked,
    with warnings) and point ``cfg.paths.output_dir`` at the checkpoint's run folder. Returns the checkpoint to pass
    to ``trainer.fit`` and this fit's ``RunRecord``. Raises ``CheckpointError`` (before any model loads) when
    ``last`` finds nothing to resume or a run it must refuse."""
    value = cfg.get("ckpt_path")
    output_dir = Path(cfg.paths.output_dir)
    trainer = cfg.get("trainer")
    max_steps = trainer.get("max_steps") if trainer is not None else None
    config = training_config(cfg)
    if value is None:
        return None, RunRecord(output_dir, config, max_steps)
    if str(value) == LAST:
        candidates = _checkpoints(output_dir.parent, output_dir)
        if not candidates:
            raise _no_earlier_run(output_dir.parent)
        ckpt = candidates[0]
        source: Path | None = ckpt.parents[1]
        ckpt_path = str(ckpt)
        record = read_record(ckpt.parents[1])
        if record is None:
            rank_zero_warn(
                f"ckpt_path=last: resuming {ckpt.parents[1]}, which has no {RECORD} (made before lightning-gkd "
                "recorded runs): its config and whether it finished cannot be checked against this run."
            )
        else:
            findings = resume_findings(record, config, max_steps)
            if findings:
                older = _matching_older(candidates[1:], config, max_steps)
                hint = f"\n  An older run matches this config: ckpt_path={older}" if older else ""
                raise CheckpointError(
                    f"ckpt_path=last: refusing to resume the newest run, {ckpt.parents[1]}:\n  - "
                    + "\n  - ".join(findings)
                    + f"\n  To start a new run instead, drop ckpt_path; to resume it anyway, pass its checkpoint: "
                    f"ckpt_path={ckpt}{hint}"
                )
    else:
        ckpt_path = str(value)
        require_checkpoint(ckpt_path)  # before loading any model
        source = run_folder(ckpt_path)
        record = read_record(source) if source is not None else None
        if record is not None:
            for finding in resume_findings(record, config, max_steps):
                rank_zero_warn(f"ckpt_path={ckpt_path}: resuming anyway (an explicit checkpoint), but {finding}")
    launched_in = None
    if source is not None and source.resolve() != output_dir.resolve():
        launched_in = output_dir
        with open_dict(cfg):
            cfg.paths.output_dir = str(source.resolve())  # ${paths.output_dir} elsewhere follows (resolved lazily)
    run_dir = Path(cfg.paths.output_dir)
    if is_rank_zero():
        into = f" into its run folder {run_dir}" if launched_in is not None else ""
        print(f"resuming from {ckpt_path}{into}", flush=True)
    return ckpt_path, RunRecord(run_dir, config, max_steps, ckpt_path=ckpt_path, launched_in=launched_in)


def resolve_ckpt_path(value: str | None, output_dir: str | Path) -> str | None:
    """``ckpt_path`` as given, or for ``last`` the newest ``checkpoints/last.ckpt`` among the other runs in the
    folder holding this run's ``output_dir`` (``outputs/runs/`` by default). No record checks: see ``plan_resume``."""
    if value is None or str(value) != LAST:
        return value
    output_dir = Path(output_dir)
    return str(latest_run_checkpoint(output_dir.parent, exclude=output_dir))


def checkpoint_step(ckpt_path: str | Path) -> int | None:
    """The global step a (single-file, local) checkpoint was saved at, read without loading its tensors."""
    try:
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
        return int(state["global_step"])
    except Exception:  # a sharded folder, a remote path, an old format: the caller does without
        return None


def continue_csv_logs(loggers: list[Any], from_step: int | None) -> None:
    """Keep the rows of an existing ``metrics.csv`` that a resumed fit continues: Lightning's CSV logger deletes
    the file when it starts in a folder that has one. Rows logged at ``from_step`` or later (a resume from an
    older checkpoint) are dropped; the resumed fit logs those steps again. Global rank zero only."""
    if not is_rank_zero():
        return
    for logger in loggers:
        if not isinstance(logger, CSVLogger):
            continue
        path = Path(logger.log_dir) / "metrics.csv"
        if not path.is_file():
            continue
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            fields, rows = list(reader.fieldnames or []), list(reader)
        if from_step is not None:
            rows = [row for row in rows if not row.get("step") or int(float(row["step"])) < from_step]
        with warnings.catch_warnings():  # "Previous log files ... will be deleted": we write them back below
            warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
            writer = logger.experiment  # creates the writer, which deletes metrics.csv
        keys = sorted(fields)
        with open(path, "w", newline="") as handle:
            out = csv.DictWriter(handle, fieldnames=keys)
            out.writeheader()
            out.writerows(rows)
        writer.metrics_keys = keys  # the writer appends under this header (and rewrites it for new keys)


def fold_launch_folder(launched_in: Path, run_dir: Path) -> Path | None:
    """Move what Hydra wrote for this launch (``.hydra/``, ``*.log``) from ``launched_in`` into
    ``<run_dir>/resumes/<name>/`` and remove ``launched_in`` when nothing else is left in it. Global rank zero,
    after the fit (other ranks only append to their open log files, which a move keeps). Returns the new folder."""
    if not is_rank_zero() or not launched_in.is_dir() or launched_in.resolve() == run_dir.resolve():
        return None
    target = run_dir / "resumes" / launched_in.name
    target.mkdir(parents=True, exist_ok=True)
    for entry in launched_in.iterdir():
        if entry.name == ".hydra" or entry.suffix == ".log":
            shutil.move(str(entry), str(target / entry.name))
    try:
        launched_in.rmdir()
    except OSError:
        pass  # something else was written there: leave it
    return target
