"""On-policy distillation with tools against supervised distillation on tool transcripts, on a toy agentic task
(``ToolTask``: its rows, tools, rollout, failure classifier and report; ``TASKS`` holds the shipped ones: ``tools``,
``lightning_gkd.toy.tools``, and ``recovery``, ``lightning_gkd.toy.recovery``).

Every method starts from the task's shipped student (assets/<task>/student_init) and distils its shipped teacher
(assets/<task>/teacher) with the same steps and batch size:

- SFT on teacher transcripts: cross-entropy on the teacher's own greedy tool transcripts of the training prompts;
- supervised KD (λ=0): the teacher's distributions on those transcripts (every assistant turn; tool turns masked);
- GKD with tools, on-policy (λ=1) and mixed (λ=0.5), at several β: the student acts with the tools, the teacher
  scores its tokens;
- OPD with tools (γ=0), and speculative KD (the teacher keeps the student's proposals in its top-5).

A method with a fixed learning rate (``Method.lr``) runs every seed at it; the others pick theirs on the first seed
(best validation success over their rates). Held-out success is scored on greedy rollouts with the tools; every
transcript is classified (the task's ``failure_kind``). With ``compute_matched`` the off-policy methods also run as
many steps as the best on-policy recipe's measured training seconds buy at their own seconds per step. Writes
docs/results_<task>.json and the task's section of docs/results.md (``main``; scripts/reproduce_tools.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from lightning_gkd.studies.results_page import update_results_section
from lightning_gkd.studies.tool_reports import recovery_report_lines, tools_report_lines

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Method:
    """A recipe of the study: ``kind`` "sft", "gkd" or "opd", GKD's λ and β, its learning rates (``lr``: one fixed
    rate; else ``lrs``, or the study's ``--lrs``, swept on the first seed) and SpeculativeKDSampler options (``skd``;
    None: the default sampler)."""

    name: str
    kind: str
    lmbda: float = 0.0
    beta: float = 0.0
    lrs: tuple[float, ...] | None = None
    skd: dict[str, Any] | None = None
    lr: float | None = None

    @property
    def on_policy(self) -> bool:
        """Whether the student samples its own transcripts (OPD, or GKD with λ > 0)."""
        return self.kind == "opd" or self.lmbda > 0


@dataclass(frozen=True)
class ToolTask:
    """A toy agentic task as the study runs it: ``name`` (the results.md section; results_<name>.json), ``assets``
    (the folder of its teacher and student_init), its rows (``rows(split)``), tools and the row columns they read,
    its rollout (``rollout(tokenizer)``) and caps, ``failure_kind(transcript, row)`` with its ``outcomes`` (those in
    ``successes`` count as held-out successes), the methods compared, and ``report(saved, task)``: the section's
    lines."""

    name: str
    module: str
    assets: str
    rows: Callable[..., list[dict[str, Any]]]
    rollout: Callable[[Any], Any]
    failure_kind: Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any]], str]
    outcomes: tuple[str, ...]
    successes: tuple[str, ...]
    tools: tuple[str, ...]
    state_columns: tuple[str, ...]
    max_tool_calling_iterations: int
    max_new_tokens: int
    max_transcript_tokens: int
    methods: tuple[Method, ...]
    report: Callable[[Mapping[str, Any], ToolTask], list[str]]
    #: keep only the teacher's transcripts classified ``correct`` as training rows (no error states in them)
    clean_transcripts_only: bool = False

    def method(self, name: str) -> Method:
        """The method called ``name``; ValueError listing the task's methods otherwise."""
        for method in self.methods:
            if method.name == name:
                return method
        raise ValueError(f"no method {name!r} in the {self.name} study; its methods: {[m.name for m in self.methods]}")


#: speculative KD's sampler options: the teacher keeps the student's proposals in its top-5, else draws
SKD: dict[str, Any] = {"accept_top_k": 5, "draft_tokens": 4}


def _tools_task() -> ToolTask:
    from lightning_gkd.toy import tools

    return ToolTask(
        name="tools",
        module="lightning_gkd.toy.tools",
        assets="toy_tools",
        rows=tools.tool_rows,
        rollout=tools.task_rollout,
        failure_kind=tools.failure_kind,
        outcomes=tools.OUTCOMES,
        successes=("correct",),
        tools=tools.TOOLS,
        state_columns=("facts",),
        max_tool_calling_iterations=tools.MAX_TOOL_CALLING_ITERATIONS,
        max_new_tokens=tools.MAX_NEW_TOKENS,
        max_transcript_tokens=tools.MAX_TRANSCRIPT_TOKENS,
        methods=(
            Method("SFT on teacher transcripts", "sft"),
            Method("Supervised KD (λ=0)", "gkd"),
            Method("GKD with tools λ=1 β=0", "gkd", lmbda=1.0, beta=0.0),
            Method("GKD with tools λ=1 β=1", "gkd", lmbda=1.0, beta=1.0),
            Method("Mixed λ=0.5 β=0", "gkd", lmbda=0.5, beta=0.0),
            Method("Mixed λ=0.5 β=0.5 (the default)", "gkd", lmbda=0.5, beta=0.5),
            # a policy gradient: smaller steps (OPD on chain: 3e-4)
            Method("OPD with tools", "opd", lrs=(1e-4, 3e-4, 1e-3)),
            # speculative KD (SKD), every turn of a rollout
            Method("SKD K=5 with tools λ=1 β=1", "gkd", lmbda=1.0, beta=1.0, skd=SKD),
        ),
        report=tools_report_lines,
    )


def _recovery_task() -> ToolTask:
    from lightning_gkd.toy import recovery

    # each method's rate is the one the tools study chose for it (docs/results_tools.json); β=0.5 and β=1 rates for
    # the λ the tools study did not run are its rates of the same β
    def gkd(lmbda: float, beta: float, lr: float, name: str) -> Method:
        return Method(name, "gkd", lmbda=lmbda, beta=beta, lr=lr)

    return ToolTask(
        name="recovery",
        module="lightning_gkd.toy.recovery",
        assets="toy_recovery",
        rows=recovery.recovery_rows,
        rollout=recovery.task_rollout,
        failure_kind=recovery.failure_kind,
        outcomes=recovery.OUTCOMES,
        successes=recovery.SUCCESSES,
        tools=recovery.TOOLS,
        state_columns=recovery.STATE_COLUMNS,
        max_tool_calling_iterations=recovery.MAX_TOOL_CALLING_ITERATIONS,
        max_new_tokens=recovery.MAX_NEW_TOKENS,
        max_transcript_tokens=recovery.MAX_TRANSCRIPT_TOKENS,
        methods=(
            Method("SKD K=5 with tools λ=1 β=1", "gkd", lmbda=1.0, beta=1.0, skd=SKD, lr=3e-3),
            Method("SFT on teacher transcripts", "sft", lr=1e-2),
            Method("Supervised KD (λ=0)", "gkd", lr=1e-2),
            gkd(1.0, 0.0, 1e-2, "GKD with tools λ=1 β=0"),
            gkd(1.0, 0.5, 3e-3, "GKD with tools λ=1 β=0.5"),
            gkd(1.0, 1.0, 3e-3, "GKD with tools λ=1 β=1"),
            gkd(0.5, 0.0, 1e-2, "Mixed λ=0.5 β=0"),
            gkd(0.5, 0.5, 3e-3, "Mixed λ=0.5 β=0.5 (the default)"),
            gkd(0.5, 1.0, 3e-3, "Mixed λ=0.5 β=1"),
            Method("OPD with tools", "opd", lr=1e-4),
        ),
        report=recovery_report_lines,
        clean_transcripts_only=True,
    )


#: The studies this module runs, by ``--task``.
TASKS: dict[str, Callable[[], ToolTask]] = {"tools": _tools_task, "recovery": _recovery_task}


def get_task(name: str) -> ToolTask:
    """The study task called ``name``; ValueError naming the known ones otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown tools study task {name!r}; known: {sorted(TASKS)}.")
    return TASKS[name]()


def task_tokenizer(task: ToolTask) -> Any:
    """The task's tokenizer (its teacher's, which the student shares)."""
    from lightning_gkd.data.tokenizer import load_tokenizer
    from lightning_gkd.toy.tiny import asset_path

    return load_tokenizer(asset_path(f"{task.assets}/teacher"))


def score(task: ToolTask, model: Any, rows: list[dict], temperature: float = 0.0) -> dict[str, Any]:
    """Rollouts with the task's tools, greedy (``temperature`` 0) or sampled at ``temperature`` (seeded per batch and
    turn). Returns success (the share of rows whose outcome is one of the task's successes), the share of every
    outcome, tool calls and failed calls per transcript, and the first transcript."""
    from lightning_gkd.ops.decoding.sampling import complete_prompts
    from lightning_gkd.rollouts.evaluate import rollout_rows

    tok = task_tokenizer(task)

    def sample(ids: Any, mask: Any, seed: int) -> Any:
        return complete_prompts(
            model, tok, ids, mask, max_new_tokens=task.max_new_tokens, temperature=temperature, seed=seed
        )

    transcripts, stats = rollout_rows(
        model,
        tok,
        rows,
        task.rollout(tok),
        max_new_tokens=task.max_new_tokens,
        sample=sample if temperature > 0 else None,
    )
    outcomes = Counter(task.failure_kind(t, row) for t, row in zip(transcripts, rows, strict=True))
    metrics = stats.metrics()
    return {
        "success": sum(outcomes[name] for name in task.successes) / len(rows),
        "outcomes": {name: outcomes[name] / len(rows) for name in task.outcomes},
        "calls": metrics["calls"],
        "failures": metrics["failures"],
        "example": transcripts[0],
    }


def teacher_transcripts(task: ToolTask, rows: list[dict], cache: Path) -> list[dict]:
    """The teacher's greedy tool transcripts of ``rows``' prompts, as training rows (cached in ``cache``): those that
    end on an answer, and with ``task.clean_transcripts_only`` only those classified ``correct``. Returns the rows."""
    if cache.exists():
        return json.loads(cache.read_text())
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.rollouts.evaluate import rollout_rows
    from lightning_gkd.toy.tiny import asset_path

    tok = task_tokenizer(task)
    teacher = load_causal_lm(asset_path(f"{task.assets}/teacher"))
    transcripts, _ = rollout_rows(teacher, tok, rows, task.rollout(tok), max_new_tokens=task.max_new_tokens)
    out = []
    for messages, row in zip(transcripts, rows, strict=True):
        if messages[-1]["role"] != "assistant":
            continue
        if task.clean_transcripts_only and task.failure_kind(messages, row) != "correct":
            continue
        out.append({"messages": messages, **{c: row[c] for c in task.state_columns}, "answer": row["answer"]})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


def train_one(job: dict[str, Any]) -> dict[str, Any]:
    """One run (a picklable job description in, a result dict out: the method, seed, rate, steps, validation and
    test success, outcome shares, calls and failures per transcript, training seconds and an example transcript)."""
    import lightning as L
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from lightning_gkd import ChatDataModule
    from lightning_gkd.cli.compose import build_method
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.samplers import SpeculativeKDSampler
    from lightning_gkd.studies.step_timing import plain_trainer
    from lightning_gkd.toy.tiny import asset_path

    torch.set_num_threads(job["threads"])
    task = get_task(job.get("task", "tools"))
    method = task.method(job["method"])
    L.seed_everything(job["seed"], workers=True)
    tok = task_tokenizer(task)
    student = load_causal_lm(asset_path(f"{task.assets}/student_init"))
    steps = job["steps"]
    common: dict[str, Any] = dict(
        optimizer=partial(torch.optim.AdamW, lr=job["lr"]),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=max(1, steps // 10), num_training_steps=steps
        ),
        tokenizer=tok,
    )
    rollout = [
        f"method.rollout.tools=[{','.join(task.tools)}]",
        f"method.rollout.tool_state_columns=[{','.join(task.state_columns)}]",
        f"method.rollout.max_tool_calling_iterations={task.max_tool_calling_iterations}",
        f"method.rollout.max_transcript_tokens={task.max_transcript_tokens}",
        f"method.sampling.max_new_tokens={task.max_new_tokens}",
        "method.sampling.temperature=1.0",
    ]
    seed = f"seed={job['seed']}"
    teacher = asset_path(f"{task.assets}/teacher")
    if method.kind == "sft":
        module: Any = build_method(["method=sft", seed], model=student, **common)
    elif method.kind == "opd":
        module = build_method(["method=opd", *rollout, seed], student=student, teacher=teacher, **common)
    else:
        if method.skd is not None:
            common["sampler"] = partial(SpeculativeKDSampler, **method.skd)
        settings = [
            "method=gkd",
            f"method.lmbda={method.lmbda}",
            f"method.divergence.beta={method.beta}",
            *rollout,
            seed,
        ]
        module = build_method(settings, student=student, teacher=teacher, **common)
    data = ChatDataModule(
        tok,
        json.loads(Path(job["train_rows"]).read_text()),
        batch_size=job["batch_size"],
        max_length=task.max_transcript_tokens,
        seed=job["seed"],
        assistant_turns="all",
    )
    data.use_rollouts(task.rollout(tok).tools)  # SFT renders the tools too (the on-policy methods do it themselves)
    trainer = plain_trainer(steps, default_root_dir=job["work_dir"])
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - started
    rows = {split: task.rows(split) for split in ("val", "test")}
    if job["fast"]:
        rows = {split: r[:32] for split, r in rows.items()}
    val = score(task, module.model, rows["val"][:128])
    test = score(task, module.model, rows["test"][: job.get("test_rows")])
    print(f"{method.name}, seed {job['seed']}, {steps} steps: held-out success {test['success']:.3f}", flush=True)
    return {
        "method": method.name,
        "seed": job["seed"],
        "lr": job["lr"],
        "steps": steps,
        "val_success": val["success"],
        "test_success": test["success"],
        "outcomes": test["outcomes"],
        "calls": test["calls"],
        "failures": test["failures"],
        "seconds_per_step": seconds / steps,
        "example": test["example"],
    }


def run_jobs(jobs: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """Every job's ``train_one`` result, in order: in this process with one worker, else in ``workers`` spawned
    processes."""
    if workers <= 1:
        return [train_one(job) for job in jobs]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(train_one, jobs))


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(task: ToolTask, runs: list[dict], chosen: Mapping[str, float]) -> list[dict[str, Any]]:
    """One row per method of ``chosen`` (at its chosen rate), in the task's order: the rate, test success per seed
    and mean ± std, outcome shares, calls (and failed calls, where recorded) per transcript, seconds per step."""
    out = []
    for method in task.methods:
        if method.name not in chosen:
            continue
        mine = [r for r in runs if r["method"] == method.name and r["lr"] == chosen[method.name]]
        mine.sort(key=lambda r: r["seed"])
        success = [r["test_success"] for r in mine]
        outcomes = {name: statistics.fmean(r["outcomes"][name] for r in mine) for name in task.outcomes}
        row = {
            "method": method.name,
            "lr": chosen[method.name],
            "per_seed": success,
            "mean_std": mean_std(success),
            "outcomes": outcomes,
            "calls": statistics.fmean(r["calls"] for r in mine),
            "seconds_per_step": statistics.fmean(r["seconds_per_step"] for r in mine),
        }
        if all("failures" in r for r in mine):
            row["failures"] = statistics.fmean(r["failures"] for r in mine)
        if all("steps" in r for r in mine):
            row["steps"] = mine[0]["steps"]
        out.append(row)
    return out


def best_on_policy(task: ToolTask, rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The on-policy method's table row with the best mean test success."""
    on_policy = {m.name for m in task.methods if m.on_policy}
    return max((row for row in rows if row["method"] in on_policy), key=lambda row: row["mean_std"][0])


def main(argv: list[str] | None = None) -> int:
    """The study's command line (scripts/reproduce_tools.py): runs it, or with ``--rerender`` rewrites the task's
    section from its JSON. Returns the exit status."""
    import torch

    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.toy.tiny import asset_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="tools")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--test-rows", type=int, default=None, help="held-out rows scored (default: all 512)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true", help="1 seed, 4 steps, 32 rows: a smoke test")
    parser.add_argument("--rerender", action="store_true", help="rewrite the report from results_<task>.json only")
    parser.add_argument("--methods", nargs="+", default=None, help="subset of method names")
    parser.add_argument(
        "--compute-matched",
        action="store_true",
        help="also run the off-policy methods for the steps the best on-policy recipe's seconds buy",
    )
    parser.add_argument(
        "--add", action="store_true", help="keep <out>/results_<task>.json's runs of the other methods, add these"
    )
    args = parser.parse_args(argv)
    task = get_task(args.task)
    result_file = args.out / f"results_{task.name}.json"
    methods = [m for m in task.methods if args.methods is None or m.name in args.methods]
    if args.methods is not None and len(methods) != len(args.methods):
        unknown = sorted(set(args.methods) - {m.name for m in methods})
        parser.error(f"unknown methods {unknown}; the {task.name} study's: {[m.name for m in task.methods]}")
    if args.rerender:
        stored = json.loads(result_file.read_text())
        update_results_section(args.out / "results.md", task.name, task.report(stored, task))
        return 0
    if args.fast:
        args.seeds, args.steps, args.lrs = 1, 4, args.lrs[:1]

    def lrs(method: Method) -> list[float]:
        if method.lr is not None:
            return [method.lr]
        return list(method.lrs or args.lrs)[: 1 if args.fast else None]

    started = time.perf_counter()
    work = args.out / f".reproduce_{task.name}"
    work_rows = args.steps * args.batch_size
    # the tools study's cache keeps its first name; others name the number of prompts (compute-matched runs read more)
    train_file = work / (
        "teacher_transcripts.json" if task.name == "tools" else f"teacher_transcripts_{work_rows}.json"
    )
    transcripts = teacher_transcripts(task, task.rows("train")[:work_rows], train_file)
    test_rows = task.rows("test")[: 32 if args.fast else args.test_rows]
    teacher = score(task, load_causal_lm(asset_path(f"{task.assets}/teacher")), test_rows)
    start = score(task, load_causal_lm(asset_path(f"{task.assets}/student_init")), test_rows)
    print(f"teacher {teacher['success']:.3f}, student start {start['success']:.3f}, {len(transcripts)} transcripts")
    sampled: dict[str, Any] = {}
    if task.name != "tools":  # what on-policy steps see: the start's transcripts of training prompts at temperature 1
        student = load_causal_lm(asset_path(f"{task.assets}/student_init"))
        drawn = score(task, student, task.rows("train")[: len(test_rows)], temperature=1.0)
        sampled = {k: v for k, v in drawn.items() if k != "example"}

    def job(method: Method, seed: int, lr: float, steps: int = args.steps, rows: Path = train_file) -> dict[str, Any]:
        return dict(
            task=task.name,
            method=method.name,
            seed=seed,
            lr=lr,
            steps=steps,
            batch_size=args.batch_size,
            threads=args.threads,
            train_rows=str(rows),
            work_dir=str(work / f"{method.kind}-{seed}-{lr:g}-{steps}"),
            fast=args.fast,
            test_rows=len(test_rows),
        )

    fixed = [m for m in methods if m.lr is not None]
    swept = [m for m in methods if m.lr is None]
    # fixed-rate methods run every seed at once (listed first: the slowest first keeps the workers busy)
    first_jobs = [job(m, s, m.lr) for m in fixed for s in range(args.seeds) if m.lr is not None]
    first_jobs += [job(m, 0, lr) for m in swept for lr in lrs(m)]
    sweep = run_jobs(first_jobs, args.workers)
    chosen = {m.name: m.lr for m in fixed if m.lr is not None}
    for m in swept:
        tried = [r for r in sweep if r["method"] == m.name and r["seed"] == 0]
        chosen[m.name] = max(tried, key=lambda r: (r["val_success"], -r["lr"]))["lr"]
    runs = sweep + run_jobs([job(m, s, chosen[m.name]) for m in swept for s in range(1, args.seeds)], args.workers)
    rows = table(task, runs, chosen)
    matched: list[dict[str, Any]] = []
    matched_runs: list[dict[str, Any]] = []
    if args.compute_matched:
        matched, matched_runs = compute_matched(task, args, rows, methods, job, work)
    seconds = time.perf_counter() - started
    if args.add:  # the earlier study's other methods, their rates read back from their runs' table rows
        before = json.loads(result_file.read_text())
        names = {m.name for m in methods}
        runs = [r for r in before["runs"] if r["method"] not in names] + runs
        chosen = {**{row["method"]: row["lr"] for row in before["table"] if row["method"] not in names}, **chosen}
        seconds += before["seconds"]
        rows = table(task, runs, chosen)
    opd = next((m for m in task.methods if m.kind == "opd"), None)
    saved: dict[str, Any] = {
        "setup": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lrs": args.lrs,
            "seeds": args.seeds,
            "opd_lrs": lrs(opd) if opd is not None else [],
            "test_rows": len(test_rows),
        },
        "teacher": {k: v for k, v in teacher.items() if k != "example"},
        "start": {k: v for k, v in start.items() if k != "example"},
        "table": rows,
        "runs": runs,
        "seconds": round(seconds, 1),
        "machine": f"{platform.machine()}, {args.workers} workers x {args.threads} threads, torch {torch.__version__}",
    }
    if task.name != "tools":
        saved["setup"] |= {"fixed_lrs": {m.name: m.lr for m in methods if m.lr is not None}, "task": task.module}
        saved["start"]["example"] = start["example"]
        saved["start"]["sampled"] = sampled
    if args.compute_matched:
        saved["compute_matched"] = matched
        saved["compute_matched_runs"] = matched_runs
    args.out.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(saved, indent=1, ensure_ascii=False) + "\n")
    lines = task.report(saved, task)
    update_results_section(args.out / "results.md", task.name, lines)
    print("\n".join(lines))
    return 0


def compute_matched(
    task: ToolTask,
    args: argparse.Namespace,
    rows: Sequence[Mapping[str, Any]],
    methods: Sequence[Method],
    job: Callable[..., dict[str, Any]],
    work: Path,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The compute-matched reading: each off-policy method of ``rows`` run (every seed, its rate) for as many steps
    as the best on-policy recipe's mean training seconds buy at the off-policy method's measured seconds per step,
    on the teacher's transcripts of as many training prompts as those steps read. Returns the table rows (with
    ``steps``, ``budget_seconds`` and ``matched_to``) and the runs."""
    best = best_on_policy(task, rows)
    budget = best["seconds_per_step"] * args.steps
    by_name = {row["method"]: row for row in rows}
    jobs = []
    chosen = {}
    for method in methods:
        if method.on_policy or method.name not in by_name:
            continue
        steps = max(args.steps, round(budget / by_name[method.name]["seconds_per_step"]))
        count = steps * args.batch_size
        file = work / f"teacher_transcripts_{count}.json"
        teacher_transcripts(task, task.rows("train")[:count], file)
        chosen[method.name] = by_name[method.name]["lr"]
        jobs += [job(method, s, chosen[method.name], steps, file) for s in range(args.seeds)]
    runs = run_jobs(jobs, args.workers)
    out = []
    for row in table(task, runs, chosen):
        out.append({**row, "budget_seconds": budget, "matched_to": best["method"]})
    return out, runs
