"""The accuracy of asynchronous rollouts on the chain task (docs/results.md, "Asynchronous rollouts: staleness on the
chain task"): forward KL (``gkd_beta0``), the default mix (``mixed_lambda05``), reverse KL (``gkd_beta1``) and OPD
(``opd``), each at its chosen learning rate of the chain study (docs/results_chain.json), trained with samples drawn
``max_staleness`` optimizer steps behind the weights they train (conf/experiment/study_async.yaml: ``producer=hf``),
staleness 0, 1, 2 and 4, every seed, the same optimizer steps for all.

- ``grid``: the runs (``AsyncRun``), each one ``lightning-gkd`` run of its own overrides in its own folder;
- ``run_grid``: those runs, ``workers`` at a time, each a process pinned to one core with one torch thread; a run
  whose folder already holds its finished ``result.json`` is skipped, so an interrupted study resumes;
- ``summarize``: the runs' jobs (``lightning_gkd.cli.sweep.collect_jobs`` of each run's folder) as a JSON-ready
  summary (per recipe and staleness: the greedy and temperature-1 test accuracy of each seed, mean ± std,
  the mean per-seed change against staleness 0 in points, training seconds);
- ``async_section``: its section of docs/results.md, with readings computed from the numbers (whether forward KL at
  staleness ≤ 2 stays within ``LOSS_POINTS`` of synchronous, which recipes lose more and where, and the staleness to
  use with each recipe); ``write_async_section`` puts it between the page's ``<!-- task:async -->`` markers.

Each run is a multirun of one job (``lightning-gkd -m ... hydra.sweep.dir=<work>/<run> hydra.sweep.subdir=run``): a
multirun job is what writes ``result.json`` (``lightning_gkd.cli.sweep.SweepSummary``), a single run does not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_gkd.studies.reports import mean_std
from lightning_gkd.studies.results_page import update_results_section
from lightning_gkd.studies.study import run_from_job

#: the recipes of the study (conf/recipe), in the tables' order
RECIPES = ("gkd_beta0", "mixed_lambda05", "gkd_beta1", "opd")
STALENESS = (0, 1, 2, 4)
SEEDS = (0, 1, 2)
EXPERIMENT = "study_async"
#: the override that sets a run's staleness
STALENESS_KEY = "method.asynchronous.max_staleness"
#: the recipe the issue's bar is about: forward KL at staleness ≤ FORWARD_KL_STALENESS
FORWARD_KL = "gkd_beta0"
FORWARD_KL_STALENESS = 2
#: the largest loss of greedy test accuracy (points) against staleness 0 that counts as "within" synchronous
LOSS_POINTS = 2.0
#: docs/results.md's section name (its markers: <!-- task:async --> ... <!-- /task:async -->)
SECTION = "async"
#: in each run's folder: its process's output, and the overrides it ran with (what makes a finished run reusable)
RUN_LOG = "stdout.log"
RUN_OVERRIDES = "overrides.json"
#: the job folder inside each run's folder (hydra.sweep.subdir), and the result its job writes there
JOB_SUBDIR = "run"
JOB_RESULT = "result.json"
RECIPE_DIR = Path(__file__).resolve().parents[1] / "conf" / "recipe"


@dataclass(frozen=True)
class AsyncRun:
    """One run of the study: a recipe at a learning rate, a staleness and a seed, plus ``extra`` overrides."""

    recipe: str
    staleness: int
    seed: int
    lr: float
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """Its folder's name under the study's work folder."""
        return f"{self.recipe}_staleness{self.staleness}_seed{self.seed}"

    @property
    def overrides(self) -> list[str]:
        """Its ``lightning-gkd`` overrides (Hydra's own, the output folder, aside)."""
        return [
            f"experiment={EXPERIMENT}",
            f"recipe={self.recipe}",
            f"optimizer.lr={self.lr:g}",
            f"seed={self.seed}",
            f"{STALENESS_KEY}={self.staleness}",
            "print_config=false",
            *self.extra,
        ]

    def command(self, folder: Path) -> list[str]:
        """The process that runs it into ``folder``: a multirun of this one job, whose folder is ``folder``/run."""
        hydra = [f"hydra.sweep.dir={folder}", f"hydra.sweep.subdir={JOB_SUBDIR}"]
        return [sys.executable, "-m", "lightning_gkd.cli.train", "-m", *self.overrides, *hydra]

    def shell(self) -> str:
        """The command line a user types for it (without the output folder)."""
        return " ".join(["lightning-gkd", *self.overrides])


def recipe_name(recipe: str) -> str:
    """A recipe's name in the studies' tables (``study.recipe.name`` of conf/recipe/<recipe>.yaml)."""
    return str(OmegaConf.load(RECIPE_DIR / f"{recipe}.yaml").study.recipe.name)


def chain_learning_rates(chain_study: Mapping[str, Any], recipes: Iterable[str] = RECIPES) -> dict[str, float]:
    """Each recipe's chosen learning rate in the chain study (docs/results_chain.json: its full-arm runs' ``lr``);
    ``KeyError`` for a recipe the study did not report."""
    chosen = {run["method"]: float(run["lr"]) for run in chain_study["runs"] if run.get("arm", "full") == "full"}
    rates = {}
    for recipe in recipes:
        name = recipe_name(recipe)
        if name not in chosen:
            raise KeyError(f"The chain study reports no run of {name} ({recipe}): run its sweep first.")
        rates[recipe] = chosen[name]
    return rates


def grid(
    lrs: Mapping[str, float],
    *,
    staleness: Sequence[int] = STALENESS,
    seeds: Sequence[int] = SEEDS,
    extra: Sequence[str] = (),
) -> list[AsyncRun]:
    """The study's runs: every recipe of ``lrs`` (at its rate) x staleness x seed, recipe-major."""
    return [
        AsyncRun(recipe, int(k), int(seed), float(lr), tuple(extra))
        for recipe, lr in lrs.items()
        for k in staleness
        for seed in seeds
    ]


def run_finished(run: AsyncRun, folder: Path) -> bool:
    """Whether ``folder`` holds ``run`` finished: the same overrides, and a finished job with a study record."""
    try:
        if json.loads((folder / RUN_OVERRIDES).read_text()) != run.overrides:
            return False
    except (OSError, ValueError):
        return False
    try:
        result = json.loads((folder / JOB_SUBDIR / JOB_RESULT).read_text())
    except (OSError, ValueError):
        return False
    return str(result.get("status", "")).startswith("finished") and bool(result.get("study"))


def log_tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a run's log ("" without one)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _pinned(core: int) -> Callable[[], None]:
    def pin() -> None:  # in the child, before exec: the run and every thread it starts stay on ``core``
        os.sched_setaffinity(0, {core})

    return pin


def run_grid(
    runs: Sequence[AsyncRun],
    work: Path,
    *,
    workers: int = 2,
    poll_seconds: float = 0.5,
    say: Callable[[str], None] = print,
) -> dict[str, float]:
    """Run the runs not yet finished in ``work``/<run name>, ``workers`` processes at a time, each pinned to a core of
    its own (the cores this process may use, in turn) with ``OMP_NUM_THREADS=1``; each run's output goes to
    ``RUN_LOG`` in its folder. Returns the wall seconds of each run it ran (by name). When one fails, the others
    still running finish, none starts, and ``RuntimeError`` carries the end of the failed run's log."""
    cores = sorted(os.sched_getaffinity(0))
    workers = max(1, min(workers, len(cores)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    todo = []
    for run in runs:
        if run_finished(run, work / run.name):
            say(f"done already: {run.name}")
        else:
            todo.append(run)
    free = cores[:workers]
    running: dict[subprocess.Popen[bytes], tuple[AsyncRun, int, float]] = {}
    seconds: dict[str, float] = {}
    failed: list[str] = []
    while todo or running:
        while todo and free and not failed:
            run, core = todo.pop(0), free.pop(0)
            folder = work / run.name
            shutil.rmtree(folder, ignore_errors=True)  # an unfinished or outdated attempt: start it afresh
            folder.mkdir(parents=True)
            (folder / RUN_OVERRIDES).write_text(json.dumps(run.overrides) + "\n")
            say(f"core {core}: {run.shell()}")
            with open(folder / RUN_LOG, "wb") as log:
                process = subprocess.Popen(
                    run.command(folder), stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_pinned(core)
                )
            running[process] = (run, core, time.perf_counter())
        if failed and not running:
            break
        time.sleep(poll_seconds)
        for process in [p for p in running if p.poll() is not None]:
            run, core, started = running.pop(process)
            free.append(core)
            seconds[run.name] = time.perf_counter() - started
            folder = work / run.name
            if process.returncode != 0 or not run_finished(run, folder):
                failed.append(
                    f"{run.shell()} (in {folder}) failed with exit status {process.returncode}; the end of "
                    f"{folder / RUN_LOG}:\n{log_tail(folder / RUN_LOG)}"
                )
            else:
                say(f"finished in {seconds[run.name]:.0f} s: {run.name}")
    if failed:
        raise RuntimeError("\n\n".join(failed))
    return seconds


def _staleness(job: Mapping[str, Any]) -> int:
    value = (job.get("values") or {}).get(STALENESS_KEY)
    if value is None:
        raise ValueError(f"The job in {job.get('folder')!r} has no {STALENESS_KEY} override: not a run of this study.")
    return int(value)


def _reference(jobs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The teacher's and the student start's greedy test accuracy: a run's reference completions, else its held-out
    scores (None where no run has them)."""
    for job in jobs:
        completions = (job.get("study") or {}).get("completions") or {}
        if "teacher" in completions and "student_init" in completions:
            return {name: float(completions[name]["greedy"]["accuracy"]) for name in ("teacher", "student_init")}
    for job in jobs:
        held_out = job.get("held_out") or {}
        teacher, start = (held_out.get("teacher") or {}).get("accuracy"), (held_out.get("before") or {}).get("accuracy")
        if teacher is not None and start is not None:
            return {"teacher": float(teacher), "student_init": float(start)}
    return {"teacher": None, "student_init": None}


def _accuracy_fields(
    prefix: str, by_seed: Mapping[int, float | None], synchronous: Mapping[int, float | None]
) -> dict[str, Any]:
    """``<prefix>``: the accuracy of each seed (in ``seeds``' order), ``<prefix>_mean`` / ``_std``, and
    ``<prefix>_delta``: the mean over seeds of (accuracy − staleness 0's of the same seed), in points (None without a
    common seed)."""
    values = [by_seed[seed] for seed in by_seed]
    measured = [float(value) for value in values if value is not None]
    mean, std = mean_std(measured) if measured else (None, None)
    deltas = [
        100.0 * (float(value) - float(base))
        for seed, value in by_seed.items()
        if value is not None and (base := synchronous.get(seed)) is not None
    ]
    return {
        prefix: values,
        f"{prefix}_mean": mean,
        f"{prefix}_std": std,
        f"{prefix}_delta": sum(deltas) / len(deltas) if deltas else None,
    }


def summarize(
    jobs: Sequence[Mapping[str, Any]],
    *,
    commands: Sequence[str] = (),
    machine: str = "",
    minutes: float | None = None,
) -> dict[str, Any]:
    """The study's summary from its jobs (``collect_jobs``' entries; those without a finished study record are left
    out): ``recipes`` (per recipe, in the jobs' order: ``recipe``, ``method``, ``lr``, ``cells``: per staleness,
    ascending, ``seeds``, ``greedy`` / ``sampled`` (per seed), their ``_mean``, ``_std`` and ``_delta`` (points
    against staleness 0), ``seconds`` (mean fit seconds: training and validation) and ``train_seconds`` (mean training
    seconds, sampling included)), ``runs``, ``staleness``, ``seeds``, ``steps``,
    ``batch_size``, ``test_prompts``, ``reference`` (teacher and student start, greedy), ``loss_points``, and the
    ``commands``, ``machine`` and ``minutes`` given; ``ValueError`` when no job finished."""
    kept = [(job, run) for job in jobs if (run := run_from_job(job)) is not None]
    if not kept:
        raise ValueError("No finished run with a study record: run the grid (experiment=study_async) first.")
    runs = [
        {
            "recipe": str((job.get("values") or {}).get("recipe") or run["method"]),
            "method": run["method"],
            "staleness": _staleness(job),
            "seed": int(run["seed"]),
            "lr": float(run["lr"]),
            "test_accuracy": float(run["test_accuracy"]) if run["test_accuracy"] is not None else None,
            "test_sampled_accuracy": run.get("test_sampled_accuracy"),
            "seconds": float(run["seconds"]),
            "train_seconds": float(run["diagnostics"].get("train_seconds") or 0.0),
        }
        for job, run in kept
    ]
    seeds = sorted({run["seed"] for run in runs})
    recipes = []
    for recipe in dict.fromkeys(run["recipe"] for run in runs):
        mine = [run for run in runs if run["recipe"] == recipe]
        by_cell = {(run["staleness"], run["seed"]): run for run in mine}
        cells = []
        for k in sorted({run["staleness"] for run in mine}):
            cell_seeds = [seed for seed in seeds if (k, seed) in by_cell]
            cell: dict[str, Any] = {"staleness": k, "seeds": cell_seeds}
            for prefix, key in (("greedy", "test_accuracy"), ("sampled", "test_sampled_accuracy")):
                values = {seed: by_cell[k, seed][key] for seed in cell_seeds}
                synchronous = {seed: by_cell[0, seed][key] for seed in seeds if (0, seed) in by_cell}
                cell |= _accuracy_fields(prefix, values, synchronous)
            for key in ("seconds", "train_seconds"):
                cell[key] = sum(by_cell[k, seed][key] for seed in cell_seeds) / len(cell_seeds)
            cells.append(cell)
        recipes.append(
            {"recipe": recipe, "method": mine[0]["method"], "lr": sorted({r["lr"] for r in mine}), "cells": cells}
        )
    settings = kept[0][0]["study"].get("settings") or {}
    trained = (kept[0][0]["study"].get("completions") or {}).get("trained")
    return {
        "task": kept[0][0]["study"].get("task"),
        "experiment": EXPERIMENT,
        "recipes": recipes,
        "runs": runs,
        "staleness": sorted({run["staleness"] for run in runs}),
        "seeds": seeds,
        "steps": settings.get("steps"),
        "batch_size": settings.get("batch_size"),
        "test_prompts": len(trained["greedy"]["texts"]) if trained else None,
        "reference": _reference([job for job, _ in kept]),
        "loss_points": LOSS_POINTS,
        "commands": list(commands),
        "machine": machine,
        "minutes": minutes,
    }


# -- the section of docs/results.md ------------------------------------------------------------------------------------


def _percent(mean: float | None, std: float | None) -> str:
    return "–" if mean is None or std is None else f"{100 * mean:.1f} ± {100 * std:.1f}"


def _points(delta: float | None) -> str:
    return "–" if delta is None else f"{delta:+.1f}".replace("-", "−")


def _cell_text(cell: Mapping[str, Any], prefix: str) -> str:
    text = _percent(cell[f"{prefix}_mean"], cell[f"{prefix}_std"])
    if cell["staleness"] == 0 or cell[f"{prefix}_delta"] is None:
        return text
    return f"{text} ({_points(cell[f'{prefix}_delta'])})"


def _table(summary: Mapping[str, Any], prefix: str) -> list[str]:
    staleness = summary["staleness"]
    lines = [
        "| recipe | lr | " + " | ".join(f"staleness {k}" for k in staleness) + " |",
        "|---|---|" + "---|" * len(staleness),
    ]
    for entry in summary["recipes"]:
        cells = {cell["staleness"]: cell for cell in entry["cells"]}
        texts = [_cell_text(cells[k], prefix) if k in cells else "–" for k in staleness]
        rates = ", ".join(f"{lr:g}" for lr in entry["lr"])
        lines.append(f"| {entry['method']} | {rates} | " + " | ".join(texts) + " |")
    return lines


def loses(delta: float | None, limit: float = LOSS_POINTS) -> bool:
    """Whether a change ``delta`` (points) is a loss of more than ``limit`` points, as the section prints it (one
    decimal: a printed −2.0 is within a 2-point bar)."""
    return delta is not None and round(delta, 1) < -limit


def losses(entry: Mapping[str, Any], limit: float = LOSS_POINTS) -> list[tuple[int, float]]:
    """(staleness, Δ) of each staleness at which ``entry`` (a summary's recipe) loses more than ``limit`` points of
    greedy test accuracy against staleness 0."""
    return [
        (cell["staleness"], cell["greedy_delta"])
        for cell in entry["cells"]
        if cell["staleness"] > 0 and loses(cell["greedy_delta"], limit)
    ]


def safe_staleness(entry: Mapping[str, Any], limit: float = LOSS_POINTS) -> int:
    """The largest staleness tested up to which ``entry`` loses no more than ``limit`` points at any staleness (0
    when it loses more already at the first one above 0)."""
    safe = 0
    for cell in sorted(entry["cells"], key=lambda cell: cell["staleness"]):
        if cell["staleness"] == 0 or cell["greedy_delta"] is None:
            continue
        if loses(cell["greedy_delta"], limit):
            break
        safe = cell["staleness"]
    return safe


def _deltas_text(cells: Iterable[Mapping[str, Any]]) -> str:
    return ", ".join(
        f"{_points(c['greedy_delta'])} at staleness {c['staleness']}" for c in cells if c["greedy_delta"] is not None
    )


def _names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def reading_lines(summary: Mapping[str, Any]) -> list[str]:
    """The "Reading these numbers" list, computed from the summary: forward KL at staleness ≤ 2 against the bar, the
    recipes that lose more than the bar and where, the seeds' noise, and the staleness to use with each recipe."""
    limit = float(summary.get("loss_points", LOSS_POINTS))
    tested = [k for k in summary["staleness"] if k > 0]
    entries = summary["recipes"]
    lines = []
    forward = next((entry for entry in entries if entry["recipe"] == FORWARD_KL), None)
    if forward is not None:
        near = [
            c for c in forward["cells"] if 0 < c["staleness"] <= FORWARD_KL_STALENESS and c["greedy_delta"] is not None
        ]
        if near:
            worst = min(near, key=lambda cell: cell["greedy_delta"])
            within = not loses(worst["greedy_delta"], limit)
            verdict = "ends within" if within else "does **not** end within"
            lines.append(
                f"- Forward KL ({forward['method']}) at staleness ≤ {FORWARD_KL_STALENESS} {verdict} {limit:g} points "
                f"of synchronous (staleness 0) greedy test accuracy: Δ "
                f"{_deltas_text(near)} (points, mean over {len(summary['seeds'])} seed(s))"
                + (
                    "."
                    if within
                    else f"; it loses {-worst['greedy_delta']:.1f} points at staleness {worst['staleness']}."
                )
            )
    lost = [(entry, losses(entry, limit)) for entry in entries]
    lost = [(entry, where) for entry, where in lost if where]
    if lost:
        for entry, where in lost:
            at = _names([f"{k} ({_points(delta)})" for k, delta in where])
            lines.append(f"- {entry['method']} loses more than {limit:g} points at staleness {at}.")
    elif tested:
        lines.append(
            f"- No recipe loses more than {limit:g} points at any staleness tested "
            f"({_names([str(k) for k in tested])})."
        )
    stds = [100 * cell["greedy_std"] for entry in entries for cell in entry["cells"] if cell["greedy_std"] is not None]
    if stds and len(summary["seeds"]) > 1:
        lines.append(
            f"- Seed noise: the std over seeds of a cell is {min(stds):.1f}–{max(stds):.1f} points; a Δ compares "
            "runs of the same seed (the same data order), so it is less noisy than the difference of two cells' means."
        )
    if tested:
        groups: dict[int, list[str]] = {}
        for entry in entries:
            groups.setdefault(safe_staleness(entry, limit), []).append(entry["method"])
        top = max(tested)
        parts = []
        for k in sorted(groups, reverse=True):
            if k == 0:
                parts.append(f"keep `max_staleness=0` (synchronous) with {_names(groups[k])}")
            else:
                note = " (the largest tested)" if k == top else ""
                parts.append(f"use `max_staleness` ≤ {k}{note} with {_names(groups[k])}")
        lines.append(
            f"- Recommendation (no loss of more than {limit:g} points up to the staleness named): "
            + "; ".join(parts)
            + "."
        )
    return lines


def async_section(summary: Mapping[str, Any]) -> list[str]:
    """The study's section of docs/results.md (between its markers; see ``write_async_section``)."""
    reference = summary["reference"]
    rates = "; ".join(f"{entry['method']} {', '.join(f'{lr:g}' for lr in entry['lr'])}" for entry in summary["recipes"])
    minutes = summary.get("minutes")
    steps = f"{summary['steps']} optimizer steps of batch {summary['batch_size']}"
    prompts = summary.get("test_prompts")
    lines = [
        "## Asynchronous rollouts: staleness on the chain task",
        "",
        f"- Command: `{' && '.join(summary['commands']) or 'python scripts/async_accuracy.py'}`",
        f"- Machine: {summary['machine'] or '–'}" + (f"; total {minutes:.1f} min" if minutes is not None else ""),
        f"- Protocol: the chain study's (Task 2: {steps}, the shipped student and teacher) with each batch's student "
        "samples drawn with the weights of "
        "`method.asynchronous.max_staleness` optimizer steps before (conf/experiment/study_async.yaml, "
        "`producer=hf`: the engine is a copy of the student in the run's process; the samples depend on the seed and "
        "the staleness only). Every staleness trains the same optimizer steps. Learning rate: each recipe's chosen "
        f"rate of the chain study (docs/results_chain.json): {rates}. Seeds {summary['seeds']}.",
        "- Teacher: "
        + ("–" if reference["teacher"] is None else f"{100 * reference['teacher']:.1f}%")
        + "; student at start: "
        + ("–" if reference["student_init"] is None else f"{100 * reference['student_init']:.1f}%")
        + " (greedy test accuracy).",
        "",
        f"Greedy test accuracy (%, the final sum, {prompts or '–'} test prompts), mean ± std over seeds; in brackets "
        "the mean over seeds of each seed's change against staleness 0, in points:",
        "",
        *_table(summary, "greedy"),
        "",
        "At temperature 1 (one sample per prompt), the same layout:",
        "",
        *_table(summary, "sampled"),
        "",
        "Training seconds per run (sampling included, validation excluded; mean over seeds; one core each): "
        + "; ".join(
            f"{entry['method']} " + " / ".join(f"{cell['train_seconds']:.0f}" for cell in entry["cells"])
            for entry in summary["recipes"]
        )
        + f" (staleness {' / '.join(str(k) for k in summary['staleness'])}).",
        "",
        "Reading these numbers:",
        "",
        *reading_lines(summary),
    ]
    return lines


def write_async_section(path: Path, lines: Sequence[str]) -> None:
    """Put ``lines`` between ``path``'s ``<!-- task:async -->`` markers (docs/results.md), after the chain study's
    section, keeping the other sections (``results_page.update_results_section``)."""
    update_results_section(path, SECTION, lines)
