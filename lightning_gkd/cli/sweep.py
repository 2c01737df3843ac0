"""Multirun sweeps: job folders named by their swept overrides, and a summary table of the sweep's results.

- ``${sweep_job_dir:${hydra.job.num}}`` (``hydra.sweep.subdir`` in conf/hydra/default.yaml) names a job's folder
  ``<job number>_<its swept overrides>``, e.g. ``0_method.divergence.beta=0``: the overrides that vary across the
  sweep (read from the ``multirun.yaml`` Hydra writes in the sweep folder before any job starts; without it, all of
  the job's overrides but ``hydra.job.config.override_dirname.exclude_keys``). Characters other than letters, digits and
  ``_.,=+~-`` become ``_`` (a value with a slash stays one folder), and a name longer than ``MAX_NAME`` characters is
  cut and ends in a short hash. The name depends only on the job's own config, so a requeued job finds its folder.
- ``SweepSummary`` (a Hydra callback, registered under ``hydra.callbacks``): each job writes ``result.json`` (status,
  steps, final metrics, held-out scores, or the error) into its folder when it ends, and the sweep folder's
  ``summary.csv`` / ``summary.md`` (one row per job, the swept keys as columns) are rewritten from every job folder
  after each job (in the job's process: submitit runs jobs elsewhere) and once more, printed, when the sweep ends
  (in the launching process). A job that raised shows as ``failed``; one that left no result (killed) as well.
- A sweep of study runs (``experiment=study_addition|study_chain`` with ``recipe=...``: each job's ``result.json``
  holds a ``study`` record) also gets ``study.json`` / ``study.md`` when it ends: each recipe's learning rate chosen
  on the first seed, every seed at that rate, the gap closed per seed, step- and FLOP-matched validation
  (``lightning_gkd.studies.study``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import platform
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lightning_gkd.studies.study import study_from_jobs, study_markdown
from lightning_gkd.training.run_record import write_json_atomically

RESULT = "result.json"
MAX_NAME = 150
NAME_CHARS = re.compile(r"[^A-Za-z0-9_.,=+~\-]")


def _parse(overrides: Iterable[str]) -> list[Any]:
    return list(OverridesParser.create().parse_overrides([str(line) for line in overrides]))


def swept_keys(multirun_config: DictConfig | Mapping[str, Any]) -> list[str]:
    """The keys a sweep varies: its sweep overrides (``method.divergence.beta=0,1``) and ``hydra.sweeper.params``."""
    hydra = multirun_config.get("hydra") or {}
    overrides = (hydra.get("overrides") or {}).get("task") or []
    keys = [o.key_or_group for o in _parse(overrides) if o.is_sweep_override() and not o.is_hydra_override()]
    params = (hydra.get("sweeper") or {}).get("params") or {}
    return list(dict.fromkeys([*keys, *[str(key) for key in params]]))


def _swept_from_file(sweep_dir: Path) -> list[str] | None:
    try:
        loaded = OmegaConf.load(sweep_dir / "multirun.yaml")
        return swept_keys(loaded) if isinstance(loaded, DictConfig) else None
    except Exception:  # no such file (another sweeper), unreadable: name by every override
        return None


def job_dir_name(num: Any, overrides: Sequence[str]) -> str:
    """``<num>_<overrides joined by ,>`` as a single valid folder name (see the module docstring)."""
    name = NAME_CHARS.sub("_", ",".join(sorted(overrides)))
    name = f"{num}_{name}" if name else str(num)
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - 9]}-{digest}"
    return name


def sweep_job_dir(num: Any, *, _root_: DictConfig) -> str:
    """The ``sweep_job_dir`` resolver: this job's folder name from its overrides (``_root_`` is the job config)."""
    hydra = _root_.hydra
    exclude = set(OmegaConf.select(hydra, "job.config.override_dirname.exclude_keys", default=[]) or [])
    swept = _swept_from_file(Path(str(hydra.sweep.dir)))
    parts = [
        override.input_line
        for override in _parse(hydra.overrides.task)
        if override.key_or_group not in exclude and (swept is None or override.key_or_group in swept)
    ]
    return job_dir_name(num, parts)


OmegaConf.register_new_resolver("sweep_job_dir", sweep_job_dir, replace=True)


def job_status(result: Mapping[str, Any]) -> str:
    """How a job's run ended, from the dict ``lightning_gkd.cli.train.run`` returns."""
    if result.get("stop_signal") == "SIGINT":
        return "interrupted (Ctrl-C)"
    if result.get("teacher_unavailable"):
        return "stopped (teacher unavailable)"
    if result.get("length_guard_stop"):
        return "stopped (length guard)"
    if result.get("stopped_by_signal"):
        return f"stopped ({result.get('stop_signal') or 'signal'})"
    return "finished"


def write_job_result(
    job_dir: str | Path,
    num: Any,
    overrides: Sequence[str],
    result: Mapping[str, Any] | None = None,
    error: BaseException | None = None,
) -> dict[str, Any]:
    """``<job_dir>/result.json``: the job's status and final figures (``result``), or the error it raised."""
    payload: dict[str, Any] = {"num": num, "overrides": list(overrides)}
    if isinstance(error, KeyboardInterrupt):
        payload.update(status="interrupted (Ctrl-C)", error=str(error))
    elif error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        payload.update(status="failed", error=f"{type(error).__name__}: {first}".rstrip(": "))
    else:
        result = result or {}
        payload.update(
            status=job_status(result),
            global_step=result.get("global_step"),
            metrics=result.get("metrics") or {},
            held_out=result.get("held_out") or {},
            run_dir=result.get("run_dir"),
            student_dir=result.get("student_dir"),
            fit_seconds=result.get("fit_seconds"),
        )
        if result.get("study") is not None:  # a study run (callbacks.study_record): its curve, compute, completions
            payload["study"] = result["study"]
    write_json_atomically(Path(job_dir) / RESULT, payload)
    return payload


def _override_values(overrides: Iterable[str]) -> dict[str, str]:
    values = {}
    for override in _parse(overrides):
        if not override.is_hydra_override():
            values[override.key_or_group] = "(deleted)" if override.is_delete() else override.get_value_element_as_str()
    return values


def collect_jobs(sweep_dir: str | Path, *, final: bool) -> list[dict[str, Any]]:
    """One entry per job folder of the sweep (a folder with Hydra's ``.hydra/``), with its result when it wrote
    one; a job without one is ``failed`` once the sweep has ended (``final``), else ``running``."""
    jobs = []
    for hydra_dir in Path(sweep_dir).glob("*/.hydra"):
        job_dir = hydra_dir.parent
        try:
            result = json.loads((job_dir / RESULT).read_text())
        except (OSError, ValueError):
            result = None
        try:
            overrides = [str(line) for line in OmegaConf.load(hydra_dir / "overrides.yaml")]
        except Exception:
            overrides = list(result["overrides"]) if result else []
        if result is None:
            try:
                num = OmegaConf.load(hydra_dir / "hydra.yaml").hydra.job.num
            except Exception:
                num = None
            status = "failed (no result.json: the job was killed)" if final else "running"
            result = {"num": num, "status": status}
        jobs.append({**result, "folder": job_dir.name, "values": _override_values(overrides)})

    def order(job: dict[str, Any]) -> tuple[int, str]:
        num = str(job.get("num"))
        return (int(num) if num.isdigit() else 1 << 30, job["folder"])

    return sorted(jobs, key=order)


def summary_table(jobs: list[dict[str, Any]], swept: Sequence[str] = ()) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows: job, the swept keys (and any other key whose value differs between jobs), status, steps,
    final losses and validation metrics, held-out scores, folder."""
    keys = list(dict.fromkeys(swept))
    every = sorted({key for job in jobs for key in job["values"]})
    keys += [key for key in every if key not in keys and len({job["values"].get(key) for job in jobs}) > 1]
    metrics = sorted(
        {
            name
            for job in jobs
            for name in job.get("metrics") or {}
            if name.endswith("/loss") or name.startswith("val/")
        },
        key=lambda name: (not name.endswith("/loss"), name),
    )
    held_out = sorted(
        {(who, name) for job in jobs for who, scores in (job.get("held_out") or {}).items() for name in scores}
    )
    columns = ["job", *keys, "status", "steps", *metrics, *[f"held-out {n} ({w})" for w, n in held_out], "folder"]
    rows = []
    for job in jobs:
        row: list[Any] = [job.get("num"), *[job["values"].get(key, "") for key in keys]]
        status = str(job.get("status")) + (f": {job['error']}" if job.get("error") else "")
        row += [status, job.get("global_step")]
        row += [(job.get("metrics") or {}).get(name) for name in metrics]
        row += [((job.get("held_out") or {}).get(who) or {}).get(name) for who, name in held_out]
        rows.append([*row, job["folder"]])
    return columns, rows


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value).replace("|", "\\|")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: jobs on one machine rarely end at the same instant
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_summary(sweep_dir: str | Path, *, swept: Sequence[str] | None = None, final: bool) -> str:
    """Rewrite ``<sweep_dir>/summary.csv`` and ``summary.md`` from every job folder; returns the markdown table."""
    sweep_dir = Path(sweep_dir)
    if swept is None:
        swept = _swept_from_file(sweep_dir) or []
    with _locked(sweep_dir / ".summary.lock"):
        columns, rows = summary_table(collect_jobs(sweep_dir, final=final), swept)
        table = markdown_table(columns, rows)
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows([["" if value is None else value for value in row] for row in rows])
        for name, text in (("summary.csv", buffer.getvalue()), ("summary.md", table + "\n")):
            staging = sweep_dir / f".{name}.tmp"
            staging.write_text(text)
            staging.replace(sweep_dir / name)
    return table


def sweep_command(sweep_dir: str | Path) -> str | None:
    """The ``lightning-gkd -m`` command of a sweep, from the overrides its ``multirun.yaml`` recorded."""
    try:
        overrides = OmegaConf.load(Path(sweep_dir) / "multirun.yaml").hydra.overrides.task
    except Exception:  # no such file (another sweeper), unreadable
        return None
    return " ".join(["lightning-gkd -m", *[str(override) for override in overrides]])


def write_study(sweep_dir: str | Path) -> str | None:
    """``<sweep_dir>/study.json`` and ``study.md`` when the sweep's jobs are study runs (``lightning_gkd.studies``);
    returns the markdown, or None for a sweep without study records."""
    sweep_dir = Path(sweep_dir)
    jobs = collect_jobs(sweep_dir, final=True)
    if not any(job.get("study") for job in jobs):
        return None
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    study = study_from_jobs(jobs, command=sweep_command(sweep_dir), machine=machine)
    text = study_markdown(study)
    write_json_atomically(sweep_dir / "study.json", study)
    (sweep_dir / "study.md").write_text(text)
    return text


def in_multirun(config: DictConfig | None = None) -> bool:
    """Whether this Hydra job is part of a multirun (``config``: a config holding ``hydra``; else Hydra's own)."""
    try:
        if config is None:
            from hydra.core.hydra_config import HydraConfig

            return HydraConfig.get().mode == RunMode.MULTIRUN
        return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN
    except Exception:  # no Hydra (a notebook, a test calling run() directly)
        return False


def record_job(
    result: Mapping[str, Any] | None = None, error: BaseException | None = None, config: DictConfig | None = None
) -> None:
    """In a multirun job: write its ``result.json`` and refresh the sweep summary (for ends Hydra does not see as a
    job's end, such as ``SystemExit``). ``config`` holds ``hydra``; by default Hydra's own."""
    if not in_multirun(config):
        return
    if config is None:
        from hydra.core.hydra_config import HydraConfig

        hydra = HydraConfig.get()
    else:
        hydra = config.hydra
    write_job_result(hydra.runtime.output_dir, hydra.job.num, list(hydra.overrides.task), result, error)
    write_summary(Path(str(hydra.sweep.dir)), final=False)


class SweepSummary(Callback):
    """Hydra callback: each job's ``result.json`` and the sweep's ``summary.csv``/``summary.md`` (see the module)."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not in_multirun(config):
            return
        try:
            value = job_return.return_value  # raises the job's error when it failed
            result, error = (value if isinstance(value, Mapping) else None), None
        except Exception as raised:
            result, error = None, raised
        if job_return.status == JobStatus.FAILED and error is None:
            error = RuntimeError("the job failed")
        record_job(result, error, config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        table = write_summary(sweep_dir, swept=swept_keys(config), final=True)
        print(
            f"== lightning_gkd sweep summary ({sweep_dir}) ==\n{table}\n"
            f"written to {sweep_dir / 'summary.csv'} and {sweep_dir / 'summary.md'}",
            flush=True,
        )
        try:
            study = write_study(sweep_dir)
        except ValueError as error:  # study runs that cannot make tables yet (e.g. none finished): say why
            print(f"== lightning_gkd study: no tables ({error})", flush=True)
            return
        if study is not None:
            print(f"== lightning_gkd study ({sweep_dir / 'study.md'}) ==\n{study}", flush=True)
