"""On-policy distillation with tools against supervised distillation on tool transcripts, on the toy agentic task
(``lightning_gkd.toy.tools``: two lookups and an addition through tools, then the answer).

Every method starts from the shipped student (assets/toy_tools/student_init) and distils the shipped teacher
(assets/toy_tools/teacher) with the same steps and batch size:

- SFT on teacher transcripts: cross-entropy on the teacher's own greedy tool transcripts of the training prompts;
- supervised KD (λ=0): the teacher's distributions on those transcripts (every assistant turn; tool turns masked);
- GKD with tools, on-policy (λ=1, β=0 and β=1): the student acts with the tools, the teacher scores its tokens;
- mixed (λ=0.5, β=0);
- OPD with tools (γ=0).

Each method's learning rate is chosen on the first seed (best validation success over --lrs); the other seeds use
it. Held-out success is scored on greedy rollouts with the tools; every failed transcript is classified
(``failure_kind``). Writes docs/results_tools.json and the ``tools`` section of docs/results.md.

    python scripts/reproduce_tools.py --workers 2          # 3 seeds
    python scripts/reproduce_tools.py --fast --out /tmp/t  # 1 seed, a few steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning as L
import torch
from transformers import get_cosine_schedule_with_warmup

from lightning_gkd import ChatDataModule
from lightning_gkd.cli.compose import build_method
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.rollouts.evaluate import rollout_rows
from lightning_gkd.samplers import SpeculativeKDSampler
from lightning_gkd.studies.results_page import update_results_section
from lightning_gkd.studies.step_timing import plain_trainer
from lightning_gkd.toy.tiny import asset_path
from lightning_gkd.toy.tools import (
    MAX_NEW_TOKENS,
    MAX_TOOL_CALLING_ITERATIONS,
    MAX_TRANSCRIPT_TOKENS,
    OUTCOMES,
    TOOLS,
    failure_kind,
    task_rollout,
    tool_rows,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "sft", "gkd" or "opd"
    lmbda: float = 0.0
    beta: float = 0.0
    lrs: tuple[float, ...] | None = None  # this method's learning-rate sweep (None: --lrs)
    skd: dict[str, int] | None = None  # SpeculativeKDSampler options (sampler=skd); None: the default sampler

    @property
    def on_policy(self) -> bool:
        return self.kind == "opd" or self.lmbda > 0


METHODS = [
    Method("SFT on teacher transcripts", "sft"),
    Method("Supervised KD (λ=0)", "gkd"),
    Method("GKD with tools λ=1 β=0", "gkd", lmbda=1.0, beta=0.0),
    Method("GKD with tools λ=1 β=1", "gkd", lmbda=1.0, beta=1.0),
    Method("Mixed λ=0.5 β=0", "gkd", lmbda=0.5, beta=0.0),
    Method("Mixed λ=0.5 β=0.5 (the default)", "gkd", lmbda=0.5, beta=0.5),
    Method("OPD with tools", "opd", lrs=(1e-4, 3e-4, 1e-3)),  # a policy gradient: smaller steps (OPD on chain: 3e-4)
    # speculative KD: the teacher keeps the student's proposals in its top-5, else draws (every turn of a rollout)
    Method("SKD K=5 with tools λ=1 β=1", "gkd", lmbda=1.0, beta=1.0, skd={"accept_top_k": 5, "draft_tokens": 4}),
]


def tokenizer() -> Any:
    return load_tokenizer(asset_path("toy_tools/teacher"))


def score(model: Any, rows: list[dict]) -> dict[str, Any]:
    """Greedy rollouts with the task's tools: success, the outcome of every transcript, calls per transcript."""
    tok = tokenizer()
    transcripts, stats = rollout_rows(model, tok, rows, task_rollout(tok), max_new_tokens=MAX_NEW_TOKENS)
    outcomes = Counter(failure_kind(t, row) for t, row in zip(transcripts, rows, strict=True))
    return {
        "success": outcomes["correct"] / len(rows),
        "outcomes": {name: outcomes[name] / len(rows) for name in OUTCOMES},
        "calls": stats.metrics()["calls"],
        "example": transcripts[0],
    }


def teacher_transcripts(rows: list[dict], cache: Path) -> list[dict]:
    """The teacher's greedy tool transcripts of ``rows``' prompts, as training rows (cached in ``cache``)."""
    if cache.exists():
        return json.loads(cache.read_text())
    tok = tokenizer()
    teacher = load_causal_lm(asset_path("toy_tools/teacher"))
    transcripts, _ = rollout_rows(teacher, tok, rows, task_rollout(tok), max_new_tokens=MAX_NEW_TOKENS)
    out = [
        {"messages": t, "facts": row["facts"], "answer": row["answer"]}
        for t, row in zip(transcripts, rows, strict=True)
    ]
    out = [row for row in out if row["messages"][-1]["role"] == "assistant"]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


def train_one(job: dict[str, Any]) -> dict[str, Any]:
    """One run (a picklable job description in, a result dict out)."""
    torch.set_num_threads(job["threads"])
    method = next(m for m in METHODS if m.name == job["method"])
    L.seed_everything(job["seed"], workers=True)
    tok = tokenizer()
    student = load_causal_lm(asset_path("toy_tools/student_init"))
    steps = job["steps"]
    common: dict[str, Any] = dict(
        optimizer=partial(torch.optim.AdamW, lr=job["lr"]),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=max(1, steps // 10), num_training_steps=steps
        ),
        tokenizer=tok,
    )
    rollout = [
        f"method.rollout.tools=[{','.join(TOOLS)}]",
        "method.rollout.tool_state_columns=[facts]",
        f"method.rollout.max_tool_calling_iterations={MAX_TOOL_CALLING_ITERATIONS}",
        f"method.rollout.max_transcript_tokens={MAX_TRANSCRIPT_TOKENS}",
        f"method.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "method.sampling.temperature=1.0",
    ]
    seed = f"seed={job['seed']}"
    teacher = asset_path("toy_tools/teacher")
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
        max_length=MAX_TRANSCRIPT_TOKENS,
        seed=job["seed"],
        assistant_turns="all",
    )
    data.use_rollouts(task_rollout(tok).tools)  # SFT renders the tools too (the on-policy methods do it themselves)
    trainer = plain_trainer(steps, default_root_dir=job["work_dir"])
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - started
    rows = {split: tool_rows(split) for split in ("val", "test")}
    if job["fast"]:
        rows = {split: r[:32] for split, r in rows.items()}
    val = score(module.model, rows["val"][:128])
    test = score(module.model, rows["test"])
    return {
        "method": method.name,
        "seed": job["seed"],
        "lr": job["lr"],
        "val_success": val["success"],
        "test_success": test["success"],
        "outcomes": test["outcomes"],
        "calls": test["calls"],
        "seconds_per_step": seconds / steps,
        "example": test["example"],
    }


def run_jobs(jobs: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    if workers <= 1:
        return [train_one(job) for job in jobs]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(train_one, jobs))


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(runs: list[dict], chosen: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for method in METHODS:
        if method.name not in chosen:
            continue
        mine = [r for r in runs if r["method"] == method.name and r["lr"] == chosen[method.name]]
        mine.sort(key=lambda r: r["seed"])
        success = [r["test_success"] for r in mine]
        outcomes = {name: statistics.fmean(r["outcomes"][name] for r in mine) for name in OUTCOMES}
        out.append(
            {
                "method": method.name,
                "lr": chosen[method.name],
                "per_seed": success,
                "mean_std": mean_std(success),
                "outcomes": outcomes,
                "calls": statistics.fmean(r["calls"] for r in mine),
                "seconds_per_step": statistics.fmean(r["seconds_per_step"] for r in mine),
            }
        )
    return out


def report_lines(saved: dict[str, Any]) -> list[str]:
    rows, setup = saved["table"], saved["setup"]
    lines = [
        "## Agentic task with tools",
        "",
        "`python scripts/reproduce_tools.py` (`lightning_gkd.toy.tools`): the answer is the sum of two of a row's "
        "facts, which only the `lookup` tool can read; `add` adds; a correct transcript makes three calls, then "
        "answers. Every method starts from the same student and distils the same teacher, "
        f"{setup['steps']} steps of {setup['batch_size']} rows, learning rate chosen per method on seed 0 from "
        f"{setup['lrs']} (OPD: {setup['opd_lrs']}); held-out success = greedy rollouts with the tools on "
        f"{setup['test_rows']} test rows. "
        f"Teacher: {saved['teacher']['success']:.3f}; student at start: {saved['start']['success']:.3f}.",
        "",
        "| Method | lr | held-out success (mean ± std) | per seed | tool calls / transcript | s / step |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        mean, std = row["mean_std"]
        seeds = ", ".join(f"{v:.3f}" for v in row["per_seed"])
        lines.append(
            f"| {row['method']} | {row['lr']:g} | {mean:.3f} ± {std:.3f} | {seeds} | {row['calls']:.2f} | "
            f"{row['seconds_per_step']:.2f} |"
        )
    lines += [
        "",
        "Where the held-out transcripts end (share of test rows, mean over seeds; `failure_kind`: the first deviation "
        "from the correct procedure):",
        "",
        "| Method | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    for who, outcomes in [
        ("teacher", saved["teacher"]["outcomes"]),
        ("student at start", saved["start"]["outcomes"]),
    ] + [(row["method"], row["outcomes"]) for row in rows]:
        lines.append(f"| {who} | " + " | ".join(f"{outcomes[name]:.3f}" for name in OUTCOMES) + " |")
    lines += ["", *verdict(saved)]
    return lines


def verdict(saved: dict[str, Any]) -> list[str]:
    rows = {row["method"]: row for row in saved["table"]}
    supervised = rows["Supervised KD (λ=0)"]["mean_std"][0]
    on_policy = [m.name for m in METHODS if m.on_policy]
    best = max(on_policy, key=lambda name: rows[name]["mean_std"][0])
    gap = rows[best]["mean_std"][0] - supervised
    start = saved["start"]["success"]
    below = [name for name, row in rows.items() if min(row["per_seed"]) < start]
    lines = [
        f"Best on-policy method: {best}, {rows[best]['mean_std'][0]:.3f} against supervised KD's {supervised:.3f} "
        f"({gap * 100:+.1f} points; the goal was +5)."
    ]
    if below:
        lines.append(f"Seeds that ended below the student's start ({start:.3f}): {', '.join(below)}.")
    protocol = ("malformed call", "wrong tool or arguments", "invented a tool result", "not stopping")
    copying = ("ignored a lookup result", "ignored the sum")
    outcomes = saved["start"]["outcomes"]
    lines += [
        "",
        f"Why: the student's start already follows the tool protocol ({saved['start']['calls']:.2f} calls per "
        f"transcript; {sum(outcomes[k] for k in protocol):.3f} of its transcripts fail it) and fails by copying a "
        f"number wrong ({sum(outcomes[k] for k in copying):.3f}: a lookup result into `add`, or the sum into the "
        "answer). Those are single-token slips that do not lead the student into states the teacher's transcripts "
        "never show, which is where on-policy data helps; supervised KD on the teacher's transcripts trains the "
        "same copies from correct contexts, while on-policy steps at temperature 1 spend part of each batch on "
        "contexts after the student's own slips. The reverse-KL objectives (GKD β=1, OPD's sampled reverse KL) lose "
        "most, likely because from a 27% start mode-seeking on the student's own samples reinforces its wrong "
        "copies.",
    ]
    skd, reverse = rows.get("SKD K=5 with tools λ=1 β=1"), rows.get("GKD with tools λ=1 β=1")
    if skd is not None and reverse is not None:
        lines += [
            "",
            f"Speculative KD (the teacher keeps the student's proposals in its top-5 and replaces the others, every "
            f"turn) lifts reverse-KL GKD from {reverse['mean_std'][0]:.3f} to {skd['mean_std'][0]:.3f}: samples the "
            "teacher corrects keep fewer of the student's wrong copies, but mode-seeking on them stays far below the "
            "forward-KL and mixed recipes here.",
        ]
    default = rows.get("Mixed λ=0.5 β=0.5 (the default)")
    if default is not None:
        lines.append(
            f"The default recipe (λ=0.5, β=0.5) ends at {default['mean_std'][0]:.3f} (per seed "
            f"{', '.join(f'{a:.3f}' for a in default['per_seed'])}), above the start on every seed."
            if min(default["per_seed"]) >= start
            else f"The default recipe (λ=0.5, β=0.5) ended below the start on a seed: {default['per_seed']}."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true", help="1 seed, 4 steps, 32 rows: a smoke test")
    parser.add_argument("--rerender", action="store_true", help="rewrite the report from results_tools.json only")
    parser.add_argument("--methods", nargs="+", default=None, help="subset of method names")
    parser.add_argument(
        "--add", action="store_true", help="keep <out>/results_tools.json's runs of the other methods, add these"
    )
    args = parser.parse_args(argv)
    methods = [m for m in METHODS if args.methods is None or m.name in args.methods]
    if args.rerender:
        saved = json.loads((args.out / "results_tools.json").read_text())
        update_results_section(args.out / "results.md", "tools", report_lines(saved))
        return 0
    if args.fast:
        args.seeds, args.steps, args.lrs = 1, 4, args.lrs[:1]

    def lrs(method: Method) -> list[float]:
        return list(method.lrs or args.lrs)[: 1 if args.fast else None]

    started = time.perf_counter()
    work = args.out / ".reproduce_tools"
    train_prompts = tool_rows("train")[: args.steps * args.batch_size]
    train_file = work / "teacher_transcripts.json"
    transcripts = teacher_transcripts(train_prompts, train_file)
    test_rows = tool_rows("test")[: 32 if args.fast else None]
    teacher = score(load_causal_lm(asset_path("toy_tools/teacher")), test_rows)
    start = score(load_causal_lm(asset_path("toy_tools/student_init")), test_rows)
    print(f"teacher {teacher['success']:.3f}, student start {start['success']:.3f}, {len(transcripts)} transcripts")

    def job(method: Method, seed: int, lr: float) -> dict[str, Any]:
        return dict(
            method=method.name,
            seed=seed,
            lr=lr,
            steps=args.steps,
            batch_size=args.batch_size,
            threads=args.threads,
            train_rows=str(train_file),
            work_dir=str(work / f"{method.kind}-{seed}-{lr:g}"),
            fast=args.fast,
        )

    sweep = run_jobs([job(m, 0, lr) for m in methods for lr in lrs(m)], args.workers)
    chosen = {
        m.name: max((r for r in sweep if r["method"] == m.name), key=lambda r: (r["val_success"], -r["lr"]))["lr"]
        for m in methods
    }
    runs = sweep + run_jobs([job(m, s, chosen[m.name]) for m in methods for s in range(1, args.seeds)], args.workers)
    seconds = time.perf_counter() - started
    if args.add:  # the earlier study's other methods, their rates read back from their runs' table rows
        before = json.loads((args.out / "results_tools.json").read_text())
        names = {m.name for m in methods}
        runs = [r for r in before["runs"] if r["method"] not in names] + runs
        chosen = {**{row["method"]: row["lr"] for row in before["table"] if row["method"] not in names}, **chosen}
        seconds += before["seconds"]
    saved = {
        "setup": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lrs": args.lrs,
            "seeds": args.seeds,
            "opd_lrs": lrs(next(m for m in METHODS if m.kind == "opd")),
            "test_rows": len(test_rows),
        },
        "teacher": {k: v for k, v in teacher.items() if k != "example"},
        "start": {k: v for k, v in start.items() if k != "example"},
        "table": table(runs, chosen),
        "runs": runs,
        "seconds": round(seconds, 1),
        "machine": f"{platform.machine()}, {args.workers} workers x {args.threads} threads, torch {torch.__version__}",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results_tools.json").write_text(json.dumps(saved, indent=1, ensure_ascii=False) + "\n")
    lines = report_lines(saved)
    update_results_section(args.out / "results.md", "tools", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
