"""The run record, ``<run>/run.json``: what a run was trained with and how far it got, so ``ckpt_path=last`` can
refuse a run that finished or was configured differently.

Global rank zero writes it (atomically) when a fit starts and again when it ends:

- ``status``: ``running`` | ``finished`` | ``stopped`` (a signal or an unavailable teacher; resumable) |
  ``interrupted`` (a second Ctrl-C) | ``failed``; ``finished`` is true only for ``finished``.
- ``global_step`` (when the fit ended) and ``max_steps`` (``trainer.max_steps`` of the latest fit).
- ``fingerprint``: a hash of ``config``, the resolved config values that change the training (``training_config``;
  ``NOT_TRAINING`` lists the keys left out), and ``config`` itself, so a refusal names the keys that differ.
- ``resumes``: one entry per resumed fit (when, from which checkpoint, the folder Hydra made for that launch).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

RECORD = "run.json"
VERSION = 1

# Config keys (and everything under them) that do not change what is trained: where the run writes, what it prints
# or logs, evaluation-only settings, and the length of the run (trainer.max_steps has its own rule: a finished run
# can be extended with a larger one). Everything else counts: model, data, method, teacher, sampler, optimizer,
# scheduler, seed, trainer precision/devices/strategy/accumulation/clipping, ...
NOT_TRAINING = (
    "hydra",
    "paths",
    "ckpt_path",
    "print_config",
    "callbacks",
    "logger",
    "export",
    "export_merged",
    "push_to_hub",
    "hub_model_id",
    "hub_private_repo",
    "trainer.max_steps",
    "trainer.accelerator",
    "trainer.default_root_dir",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.limit_val_batches",
    "trainer.limit_test_batches",
    "trainer.limit_predict_batches",
    "trainer.num_sanity_val_steps",
    "trainer.log_every_n_steps",
    "trainer.enable_model_summary",
    "trainer.enable_progress_bar",
    "trainer.enable_checkpointing",
    "trainer.profiler",
    "data.val_data",
    "data.test_data",
    "data.val_batch_size",
    "method.validation",
    # the optimizer and scheduler groups as the method receives them (${optimizer}, ${scheduler}): recorded under
    # their own keys (an override restoring them names those keys)
    "method.training.optimizer",
    "method.training.scheduler",
)
# Values that interpolate these keys are recorded with a placeholder in their place: a scheduler whose length is
# ${trainer.max_steps} matches the same scheduler extended to more steps, and nothing under the run folder differs
# between two runs only because their folders do.
MAX_VALUE = 1000  # characters of JSON; longer values are recorded by their digest
PLACEHOLDERS = {"trainer.max_steps": "<trainer.max_steps>", "paths.output_dir": "<paths.output_dir>"}


def _excluded(key: str) -> bool:
    return any(key == skip or key.startswith(f"{skip}.") for skip in NOT_TRAINING)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif not _excluded(prefix):
        text = json.dumps(value, sort_keys=True, default=str)
        # a long value (rows given inline) is recorded by its digest: the record stays small, a change still shows
        out[prefix] = f"sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}" if len(text) > MAX_VALUE else value


def training_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved values of ``cfg`` that change the training, flattened to dotted keys
    (``method.divergence.beta``)."""
    masked = copy.deepcopy(cfg)
    with open_dict(masked):
        for key, placeholder in PLACEHOLDERS.items():
            if OmegaConf.select(masked, key, default=None) is not None:
                OmegaConf.update(masked, key, placeholder, merge=False)
    out: dict[str, Any] = {}
    for name in [str(key) for key in masked]:
        if not _excluded(name):
            try:
                value = OmegaConf.select(masked, name)
                resolved = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
            except Exception:  # an interpolation only the running job can resolve: compare it as written
                resolved = OmegaConf.to_container(masked, resolve=False)[name]  # type: ignore[index,call-overload]
            _flatten(resolved, name, out)
    return json.loads(json.dumps(out, sort_keys=True, default=str))  # JSON's view: what a record reads back


def fingerprint(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key whose value differs; a missing key's value is ``MISSING``."""
    return [
        (key, old.get(key, MISSING), new.get(key, MISSING))
        for key in sorted(set(old) | set(new))
        if old.get(key, MISSING) != new.get(key, MISSING)
    ]


class _Missing:
    def __repr__(self) -> str:
        return "(absent)"


MISSING: Any = _Missing()


def override_value(value: Any) -> str:
    """``value`` as Hydra's command line writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = value and all(ch.isalnum() or ch in "._-/:+@" for ch in value)
        return value if plain else json.dumps(value)
    return json.dumps(value)


def restoring_override(key: str, old: Any, new: Any) -> str:
    """The command-line override that gives ``key`` its ``old`` value back."""
    if old is MISSING:
        return f"~{key}"
    return f"{'+' if new is MISSING else ''}{key}={override_value(old)}"


def read_record(run_dir: str | Path) -> dict[str, Any] | None:
    """``<run_dir>/run.json``, or None when the run has none (made before runs were recorded) or it is unreadable."""
    path = Path(run_dir) / RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_json_atomically(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to a file beside ``path`` and rename it over ``path``: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        staging.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def is_rank_zero() -> bool:
    # rank_zero_only.rank is read from the launcher's environment (RANK, LOCAL_RANK, SLURM_PROCID) before the
    # trainer knows its rank: Lightning's DDP launcher re-runs this command with LOCAL_RANK set.
    return getattr(rank_zero_only, "rank", 0) == 0


@dataclass
class RunRecord:
    """The record of one fit in ``run_dir``: ``started`` before ``trainer.fit``, ``ended`` after it."""

    run_dir: Path
    config: dict[str, Any]
    max_steps: int | None
    ckpt_path: str | None = None
    launched_in: Path | None = None  # the folder Hydra made for this launch, when the run continues in another
    _data: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def path(self) -> Path:
        return self.run_dir / RECORD

    def started(self) -> None:
        if not is_rank_zero():
            return
        data = read_record(self.run_dir) or {"version": VERSION, "created": _now(), "resumes": []}
        if self.ckpt_path is not None:
            resume: dict[str, Any] = {"at": _now(), "ckpt_path": self.ckpt_path}
            if data.get("config") is not None:
                resume["changed"] = {
                    key: [old, new]
                    for key, old, new in config_diff(data["config"], self.config)
                    if old is not MISSING and new is not MISSING
                }
            if self.launched_in is not None:
                resume["launched_in"] = str(self.launched_in)
            data.setdefault("resumes", []).append(resume)
        data.update(
            status="running",
            finished=False,
            max_steps=self.max_steps,
            fingerprint=fingerprint(self.config),
            config=self.config,
            updated=_now(),
        )
        data.setdefault("global_step", 0)
        self._data = data
        write_json_atomically(self.path, data)

    def tracking_runs(self, ids: Mapping[str, str]) -> None:
        """Record the tracking services' run ids (``{"mlflow": run_id, "wandb": id}``) so a resume continues them."""
        if not is_rank_zero() or not self._data or not ids:
            return
        self._data.setdefault("tracking", {}).update(ids)
        write_json_atomically(self.path, self._data)

    def ended(self, status: str, global_step: int) -> None:
        if not is_rank_zero() or not self._data:
            return
        self._data.update(status=status, finished=status == "finished", global_step=global_step, updated=_now())
        write_json_atomically(self.path, self._data)


#: The logger classes whose runs a resume continues, by the key their id has in run.json's ``tracking``.
TRACKED_LOGGERS = {"MLFlowLogger": "mlflow", "WandbLogger": "wandb"}


def tracking_ids(loggers: Sequence[Any]) -> dict[str, str]:
    """``{"mlflow": run_id, "wandb": id}`` of the tracking loggers among ``loggers`` (their runs start here on rank
    zero if they had not)."""
    ids: dict[str, str] = {}
    for logger in loggers:
        kind = TRACKED_LOGGERS.get(type(logger).__name__)
        if kind == "mlflow":
            run_id = logger.run_id
        elif kind == "wandb":
            run_id = logger.experiment.id if is_rank_zero() else None
        else:
            continue
        if run_id:
            ids[kind] = str(run_id)
    return ids


def continue_tracking_runs(logger_entries: Mapping[str, Any], record: Mapping[str, Any] | None) -> list[str]:
    """Point the configured MLflow / W&B loggers (``logger_entries``: name -> config, changed in place) at the runs
    ``record`` (an earlier ``run.json``) holds, unless a run id is set already; returns what it continued."""
    ids = (record or {}).get("tracking") or {}
    continued = []
    for name, entry in logger_entries.items():
        kind = TRACKED_LOGGERS.get(str(entry.get("_target_", "")).rsplit(".", 1)[-1])
        if kind is None or kind not in ids:
            continue
        key = "run_id" if kind == "mlflow" else "id"
        if entry.get(key):
            continue
        with open_dict(entry):
            entry[key] = ids[kind]
            if kind == "wandb":
                entry["resume"] = "allow"
        continued.append(f"{name} run {ids[kind]}")
    return continued
