"""A study: methods (recipes) x seeds x learning rates, one ``lightning-gkd`` run each, read as tables.

A study is a JSON-ready dict (the schema of docs/results_chain.json and docs/results.json):

- ``task``: the toy task's name (``lightning_gkd.toy.tasks``), or None;
- ``runs``: one dict per run kept for the tables (each method's chosen learning rate): ``method``, ``seed``, ``lr``,
  ``test_accuracy`` (held-out, greedy), ``curve`` ([step, validation metric] after each validation), ``seconds``,
  ``arm`` ("full" or "low-data"), and where measured ``compute`` ([step, estimated FLOPs, training seconds]),
  ``test_sampled_accuracy`` (temperature 1), ``predictions`` / ``predictions_sampled`` (test completions),
  ``first_errors`` / ``first_errors_sampled`` (chain task) and ``diagnostics`` (named figures);
- ``sweep``: the first seed's runs of every rate tried (``method``, ``lr``, ``val``: the last validation value);
- ``reference``: ``teacher`` and ``student_init`` scores (``greedy`` / ``sampled``: ``accuracy``, and where measured
  the completions and their figures; ``student_init.val_accuracy``: where every validation curve starts);
- ``methods``: ``name``, ``description``, ``on_policy`` (or the ``kind``/``lmbda`` that say it), ``lrs`` (the rates
  tried when they differ from ``args.lrs``), ...;
- ``args``: ``steps``, ``batch_size``, ``eval_every``, ``seeds``, ``lrs``, ``low_data`` (the low-data arm's share of
  the training rows), ``low_data_methods``; ``seconds``, ``machine``, ``command``.

``study_from_jobs`` makes one from a multirun's jobs (``lightning_gkd.cli.sweep.collect_jobs``: each job's
``result.json``, whose ``study`` ``lightning_gkd.callbacks.StudyRecord`` wrote); the learning rate of each method is
the one with the best last validation value on the first seed (ties: the smaller rate), and every seed is reported
at that rate. ``study_table`` and ``study_markdown`` are its summary: per-seed test accuracy, the gap closed per
seed, and validation at matched steps and at matched estimated FLOPs. docs/results.md's sections
(``results_page``) read the same dict.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_gkd.evaluation.metrics import gap_closed
from lightning_gkd.studies.chain_analysis import first_errors
from lightning_gkd.studies.reports import fmt_gap, fmt_mean_std, mean_std
from lightning_gkd.toy.tasks import TOY_TASKS

#: the held-out metric a study reads (HeldOutEvaluation's and the toy studies' name)
METRIC = "accuracy"


def gap_fields(accuracies: Sequence[float], teacher: float, start: float) -> dict[str, Any]:
    """The recovered fraction of the teacher–student gap (``lightning_gkd.evaluation.gap_closed``) of each seed's
    test accuracy (``gap_closed_seeds``), and its mean and std over the seeds (``gap_closed``, ``gap_closed_std``);
    None when the teacher does not score above the student's start."""
    seeds = [gap_closed(acc, start, teacher) for acc in accuracies]
    values = [gap for gap in seeds if gap is not None]
    if not values:
        return {"gap_closed": None, "gap_closed_std": None, "gap_closed_seeds": seeds}
    mean, std = mean_std(values)
    return {"gap_closed": mean, "gap_closed_std": std, "gap_closed_seeds": seeds}


def method_on_policy(method: Mapping[str, Any]) -> bool:
    """Whether a study's method samples on-policy: its recipe says so (``on_policy``), or (studies written before
    recipes) it is OPD or a GKD with λ > 0."""
    if method.get("on_policy") is not None:
        return bool(method["on_policy"])
    return method.get("kind") == "opd" or float(method.get("lmbda") or 0.0) > 0


def last_validation(run: Mapping[str, Any]) -> float:
    """A run's last validation value (0 without a curve): what picks its method's learning rate."""
    return float(run["curve"][-1][1]) if run.get("curve") else 0.0


def pick_learning_rates(first_seed_runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each method's learning rate: the best last validation value among its runs (the first seed's, one per rate);
    a tie goes to the smaller rate."""
    chosen: dict[str, float] = {}
    for name in dict.fromkeys(run["method"] for run in first_seed_runs):
        tried = [run for run in first_seed_runs if run["method"] == name]
        chosen[name] = float(max(tried, key=lambda run: (last_validation(run), -run["lr"]))["lr"])
    return chosen


def _held_out(job: Mapping[str, Any], who: str) -> float | None:
    scores = (job.get("held_out") or {}).get(who) or {}
    return scores.get(METRIC, next(iter(scores.values()), None) if len(scores) == 1 else None)


def run_from_job(job: Mapping[str, Any]) -> dict[str, Any] | None:
    """A study run from one finished job (its ``result.json`` with a ``study`` record); None for a job without."""
    record = job.get("study")
    if not record or not str(job.get("status", "")).startswith("finished"):
        return None
    trained = (record.get("completions") or {}).get("trained")
    test_accuracy = trained["greedy"]["accuracy"] if trained else _held_out(job, "after")
    metrics = record.get("metrics") or {}
    alerts = record.get("length_guard_alerts") or []
    diagnostics: dict[str, float] = {
        **{f"tokens_{name}": float(count) for name, count in (record.get("tokens") or {}).items()},
        "train_flops": float(record.get("train_flops") or 0.0),
        "train_seconds": float(record.get("train_seconds") or 0.0),
        "guard_alerts": float(len(alerts)),
        "guard_first_step": float(alerts[0]) if alerts else -1.0,
        **{
            name.replace("/", "_"): value
            for name, value in metrics.items()
            if name.startswith(("train/", "val/length", "val/eos_rate"))
        },
    }
    run: dict[str, Any] = {
        "method": record["recipe"]["name"],
        "seed": record["seed"],
        "lr": record["lr"],
        "test_accuracy": test_accuracy,
        "curve": record.get("curve") or [],
        "seconds": float(job.get("fit_seconds") or 0.0),
        "arm": record.get("arm") or "full",
        "compute": record.get("compute") or [],
    }
    if trained:
        rows = _test_rows(record.get("task"), len(trained["greedy"]["texts"]))
        for mode, suffix in (("greedy", ""), ("sampled", "_sampled")):
            scores = trained[mode]
            run[f"predictions{suffix}"] = scores["texts"]
            if rows is not None and record.get("task") == "chain":
                run[f"first_errors{suffix}"] = first_errors(scores["texts"], rows)
            diagnostics |= {f"{mode}_{k}": v for k, v in scores.items() if k != "texts"}
        run["test_sampled_accuracy"] = trained["sampled"]["accuracy"]
    run["diagnostics"] = diagnostics
    return run


def _test_rows(task: str | None, count: int) -> list[dict[str, Any]] | None:
    """The first ``count`` test rows of a toy task (a shorter test split is a prefix of the full one)."""
    return TOY_TASKS[task].rows("test")[:count] if task in TOY_TASKS else None


def _reference(jobs: Sequence[Mapping[str, Any]], task: str | None) -> dict[str, Any]:
    """The teacher's and the student start's scores: a job's reference completions (``StudyRecord(reference=True)``),
    else its held-out teacher and "before" accuracies."""
    for job in jobs:
        scores = ((job.get("study") or {}).get("completions") or {}).copy()
        scores.pop("trained", None)
        if "teacher" in scores and "student_init" in scores:
            reference = {name: dict(value) for name, value in scores.items()}
            for name in ("teacher", "student_init"):
                for mode in ("greedy", "sampled"):
                    entry = dict(reference[name][mode])
                    rows = _test_rows(task, len(entry["texts"]))
                    if rows is not None and task == "chain":
                        entry["first_errors"] = first_errors(entry["texts"], rows)
                    reference[name][mode] = entry
            return reference
    for job in jobs:
        teacher, start = _held_out(job, "teacher"), _held_out(job, "before")
        if teacher is not None and start is not None:
            return {"teacher": {"greedy": {"accuracy": teacher}}, "student_init": {"greedy": {"accuracy": start}}}
    raise ValueError(
        "No job of the sweep scored the teacher and the student's start (held_out_eval with an in-process teacher, "
        "or callbacks.study_record.reference=true): the tables need both for the gap closed."
    )


def study_from_jobs(
    jobs: Sequence[Mapping[str, Any]], *, command: str | None = None, machine: str | None = None
) -> dict[str, Any]:
    """The study of a multirun's jobs (see the module docstring); ``ValueError`` when none has a study record."""
    runs = [run for job in jobs if (run := run_from_job(job)) is not None]
    if not runs:
        raise ValueError(
            "No finished job of this sweep has a study record: run the sweep with experiment=study_addition or "
            "study_chain (or add callbacks.study_record) and a recipe (conf/recipe)."
        )
    records = [job["study"] for job in jobs if run_from_job(job) is not None]
    task = records[0].get("task")
    full = [run for run in runs if run["arm"] == "full"] or runs  # a sweep of the low-data arm alone: its own
    seeds = sorted({run["seed"] for run in full})
    first = [run for run in full if run["seed"] == seeds[0]]
    chosen = pick_learning_rates(first)
    names = list(dict.fromkeys(run["method"] for run in runs))
    grids = {name: sorted({run["lr"] for run in first if run["method"] == name}) for name in names}
    common = Counter(tuple(grid) for grid in grids.values() if grid).most_common(1)
    lrs = list(common[0][0]) if common else []
    recipes = {record["recipe"]["name"]: record["recipe"] for record in records}
    order = {name: index for index, name in enumerate(names)}
    kept = [run for run in runs if run["method"] in chosen and run["lr"] == chosen[run["method"]]]
    kept.sort(key=lambda run: (run["arm"] != "full", order[run["method"]], run["seed"]))
    low_data_rows = [record["settings"]["train_rows"] for record in records if record.get("arm") == "low-data"]
    full_rows = [record["settings"]["train_rows"] for record in records if record.get("arm", "full") == "full"]
    settings = records[0].get("settings") or {}
    return {
        "task": task,
        "runs": kept,
        "sweep": [{"method": run["method"], "lr": run["lr"], "val": last_validation(run)} for run in first],
        "reference": _reference(jobs, task),
        "methods": [
            {
                **{key: value for key, value in recipes[name].items() if key != "name"},
                "name": name,
                "description": recipes[name].get("description", ""),
                "lrs": None if grids[name] == lrs else grids[name],
            }
            for name in names
            if name in chosen
        ],
        "seconds": sum(float(job.get("fit_seconds") or 0.0) for job in jobs),
        "machine": machine or "",
        "command": command or "",
        "args": {
            "steps": settings.get("steps"),
            "batch_size": settings.get("batch_size"),
            "eval_every": settings.get("eval_every"),
            "seeds": seeds,
            "lrs": lrs,
            "low_data": low_data_rows[0] / full_rows[0] if low_data_rows and full_rows and full_rows[0] else 0.0,
            "low_data_methods": list(dict.fromkeys(run["method"] for run in kept if run["arm"] == "low-data")),
        },
    }


def merged_study(before: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The earlier study's runs, sweeps and methods with the methods of ``new`` added (or replaced); the commands and
    times of both are kept, and the earlier low-data methods."""
    names = {method["name"] for method in new["methods"]}

    def kept(items: Sequence[Mapping[str, Any]], key: str) -> list[Mapping[str, Any]]:
        return [item for item in items if item[key] not in names]

    return {
        **new,
        "runs": kept(before["runs"], "method") + list(new["runs"]),
        "sweep": kept(before["sweep"], "method") + list(new["sweep"]),
        "methods": kept(before["methods"], "name") + list(new["methods"]),
        "seconds": before["seconds"] + new["seconds"],
        "command": f"{before['command']} && {new['command']}",
        "args": {**before["args"], "low_data_methods": before["args"]["low_data_methods"]},
    }


def full_runs(study: Mapping[str, Any], method: str) -> list[Mapping[str, Any]]:
    """``method``'s runs of the full arm (every seed, its chosen rate), in the study's order."""
    return [run for run in study["runs"] if run["method"] == method and run.get("arm", "full") == "full"]


def mean_curves(study: Mapping[str, Any], method: str) -> dict[str, list[tuple[float, float]]]:
    """Mean over ``method``'s full-arm seeds: the validation value against optimizer step, estimated FLOPs and
    training seconds, from the student's start (0, its validation value) when the study has it."""
    runs = [run for run in full_runs(study, method) if run["curve"]]
    if not runs:
        return {"step": [], "flops": [], "seconds": []}
    n = min(len(run["curve"]) for run in runs)
    start = study["reference"]["student_init"].get("val_accuracy")
    acc = [statistics.fmean(run["curve"][i][1] for run in runs) for i in range(n)]
    steps = [float(runs[0]["curve"][i][0]) for i in range(n)]
    curves = {"step": list(zip(steps, acc, strict=True))}
    if all(len(run.get("compute") or []) >= n for run in runs):
        for key, index in (("flops", 1), ("seconds", 2)):
            values = [statistics.fmean(run["compute"][i][index] for run in runs) for i in range(n)]
            curves[key] = list(zip(values, acc, strict=True))
    else:
        curves["flops"], curves["seconds"] = [], []
    if start is not None:
        curves = {key: ([(0.0, start), *points] if points else points) for key, points in curves.items()}
    return curves


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The y of the piecewise-linear curve through ``points`` (x ascending) at ``x``; None outside it."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return None


def study_table(study: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per method (full arm, its chosen rate): test accuracy per seed and mean ± std, the gap closed per seed
    and mean ± std, estimated training TFLOPs and seconds, the validation value at the last step (step-matched: every
    method ran the same steps) and at the smallest training-FLOP budget of any method (FLOP-matched, interpolated on
    each method's mean curve; ``budget_tflops``)."""
    teacher = study["reference"]["teacher"]["greedy"]["accuracy"]
    start = study["reference"]["student_init"]["greedy"]["accuracy"]
    curves = {method["name"]: mean_curves(study, method["name"]) for method in study["methods"]}
    budgets = [points[-1][0] for points in (c["flops"] for c in curves.values()) if points]
    budget = min(budgets) if budgets else None
    table = []
    for method in study["methods"]:
        runs = full_runs(study, method["name"])
        if not runs:
            continue
        accuracies = [run["test_accuracy"] for run in runs]
        flops = [run.get("diagnostics", {}).get("train_flops") for run in runs]
        seconds = [run.get("diagnostics", {}).get("train_seconds") for run in runs]
        curve = curves[method["name"]]
        table.append(
            {
                "method": method["name"],
                "description": method.get("description", ""),
                "on_policy": method_on_policy(method),
                "lr": runs[0]["lr"],
                "seeds": [run["seed"] for run in runs],
                "test": accuracies,
                "test_mean_std": mean_std(accuracies),
                **gap_fields(accuracies, teacher, start),
                "tflops": statistics.fmean(flops) / 1e12 if None not in flops else None,
                "train_seconds": statistics.fmean(seconds) if None not in seconds else None,
                "val_last_step": curve["step"][-1][1] if curve["step"] else None,
                "val_at_budget": None if budget is None else interpolate(curve["flops"], budget),
                "budget_tflops": None if budget is None else budget / 1e12,
            }
        )
    return table


def _cell(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def study_markdown(study: Mapping[str, Any]) -> str:
    """The study's summary page: how it was run, and ``study_table`` as a markdown table."""
    table = study_table(study)
    args = study["args"]
    teacher = study["reference"]["teacher"]["greedy"]["accuracy"]
    start = study["reference"]["student_init"]["greedy"]["accuracy"]
    budget = next((row["budget_tflops"] for row in table if row["budget_tflops"] is not None), None)
    step = args.get("steps")
    lines = [
        f"# Study{'' if study.get('task') is None else ': ' + str(study['task'])}",
        "",
        f"- Command: `{study['command']}`" if study.get("command") else "- Command: (not recorded)",
        f"- {len(study['sweep'])} runs on seed {args['seeds'][0]} (each method at each rate tried) pick each "
        "method's learning rate: the best last validation value (ties: the smaller rate); reported: every seed of "
        f"{args['seeds']} at that rate ({len(study['runs'])} runs). {step} optimizer steps of batch "
        f"{args.get('batch_size')}; rates {args['lrs']} (a method that tried others lists them).",
        f"- Held-out accuracy (greedy): teacher {teacher:.3f}, student start {start:.3f}. Gap closed: (run − start) / "
        "(teacher − start), per seed, then mean ± std (n/a when the teacher does not score above the start).",
        f"- Validation (mean over seeds) at the last step (step-matched) and at {_cell(budget, 2)} TFLOPs of "
        "estimated training compute, the smallest budget of any method (FLOP-matched, interpolated); estimated "
        "FLOPs: 2·params per token sampled or teacher-scored, 6·params per trained token.",
        "",
        "| method | what | lr | test accuracy (mean ± std) | per seed | gap closed (mean ± std) | train TFLOPs (est.) "
        "| train s | val, last step | val, FLOP-matched |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    tried = {method["name"]: method.get("lrs") for method in study["methods"]}
    for row in table:
        lr = f"{row['lr']:g}" + (f" (of {tried[row['method']]})" if tried.get(row["method"]) else "")
        lines.append(
            f"| {row['method']} | {row['description']} | {lr} | {fmt_mean_std(row['test_mean_std'])} "
            f"(n={len(row['test'])}) | {', '.join(f'{a:.3f}' for a in row['test'])} | "
            f"{fmt_gap(row['gap_closed'], row['gap_closed_std'])} | {_cell(row['tflops'], 2)} | "
            f"{_cell(row['train_seconds'], 0)} | {_cell(row['val_last_step'])} | {_cell(row['val_at_budget'])} |"
        )
    return "\n".join(lines) + "\n"
