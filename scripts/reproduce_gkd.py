"""Paper-style comparison on the toy task: SFT vs supervised KD vs SeqKD vs on-policy GKD.

Every method starts from the same student (lightning_gkd/assets/toy/student_init), distils the same teacher
(assets/toy/teacher) or fits the ground truth, with the same step budget and batch size, for several seeds.
Each method gets a small learning-rate sweep on the first seed (best validation accuracy wins); the other seeds
use the chosen rate. Reports held-out (test) exact-match accuracy, mean ± std over seeds, and the fraction of
the teacher-student gap closed; writes docs/results.md and docs/gkd_accuracy.png.

    python scripts/reproduce_gkd.py              # the full comparison (under 20 minutes on 2 CPU cores)
    python scripts/reproduce_gkd.py --fast --out /tmp/repro   # 1 seed, a few steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from transformers import get_cosine_schedule_with_warmup

from lightning_gkd import ChatDataModule, GKDModule, SFTModule
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.toy import addition_rows
from lightning_gkd.evaluation import evaluate_generations, exact_match
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.models.tiny import asset_path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    kind: str = "gkd"  # "gkd" or "sft"
    lmbda: float = 0.0
    beta: float = 0.0
    seq_kd: bool = False


METHODS = [
    Method("SFT", "cross-entropy on ground-truth answers", kind="sft"),
    Method("Supervised KD", "λ=0, β=0: forward KL on ground-truth answers"),
    Method("SeqKD", "seq_kd, λ=0, β=0: forward KL on teacher samples", seq_kd=True),
    Method("GKD β=0", "λ=1: on-policy, forward KL", lmbda=1.0, beta=0.0),
    Method("GKD β=0.5", "λ=1: on-policy, JSD(0.5)", lmbda=1.0, beta=0.5),
    Method("GKD β=0.9", "λ=1: on-policy, JSD(0.9)", lmbda=1.0, beta=0.9),
    Method("GKD β=1", "λ=1: on-policy, reverse KL", lmbda=1.0, beta=1.0),
    Method("Mixed λ=0.5", "λ=0.5, β=0.5: half on-policy", lmbda=0.5, beta=0.5),
]


@dataclass
class Run:
    method: str
    seed: int
    lr: float
    test_accuracy: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, val accuracy)
    seconds: float = 0.0


class AccuracyCurve(L.Callback):
    """Records (global step, val/accuracy) after every validation."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "val/accuracy" in trainer.callback_metrics and not trainer.sanity_checking:
            self.points.append((trainer.global_step, float(trainer.callback_metrics["val/accuracy"])))


def train_one(
    method: Method,
    *,
    seed: int,
    lr: float,
    steps: int,
    batch_size: int,
    eval_every: int,
    tokenizer: Any,
    rows: dict[str, list[dict]],
    work_dir: Path,
    teacher: Any = None,
) -> Run:
    """One run of ``method``; ``teacher``: GKD's teacher argument (default the shipped toy teacher's folder), e.g. a
    teacher spec (scripts/sparse_teacher_accuracy.py)."""
    L.seed_everything(seed, workers=True)
    student = load_causal_lm(asset_path("toy/student_init"))
    common = dict(
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=max(1, steps // 10), num_training_steps=steps
        ),
        metrics={"accuracy": exact_match},
        eval_max_new_tokens=8,
        seed=seed,
    )
    if method.kind == "sft":
        module: L.LightningModule = SFTModule(student, tokenizer, **common)
    else:
        module = GKDModule(
            student,
            asset_path("toy/teacher") if teacher is None else teacher,
            tokenizer,
            lmbda=method.lmbda,
            beta=method.beta,
            seq_kd=method.seq_kd,
            temperature=1.0,
            max_new_tokens=8,
            **common,
        )
    data = ChatDataModule(
        tokenizer, rows["train"], rows["val"], batch_size=batch_size, val_batch_size=256, max_length=64, seed=seed
    )
    curve = AccuracyCurve()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        val_check_interval=eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[curve],
        default_root_dir=work_dir,
    )
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    test = evaluate_generations(module.model, tokenizer, rows["test"], max_new_tokens=8)["accuracy"]
    return Run(method.name, seed, lr, test, curve.points, time.perf_counter() - started)


def summarize(runs: list[Run], methods: list[Method], teacher_acc: float, start_acc: float) -> list[dict]:
    table = []
    for method in methods:
        accs = [r.test_accuracy for r in runs if r.method == method.name]
        if not accs:
            continue
        mean = statistics.fmean(accs)
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        gap = (mean - start_acc) / (teacher_acc - start_acc) if teacher_acc > start_acc else float("nan")
        lr = next(r.lr for r in runs if r.method == method.name)
        table.append(
            {
                "method": method.name,
                "description": method.description,
                "lr": lr,
                "seeds": len(accs),
                "mean": mean,
                "std": std,
                "gap_closed": gap,
            }
        )
    return table


def write_report(
    out: Path,
    table: list[dict],
    runs: list[Run],
    *,
    teacher_acc: float,
    start_acc: float,
    args: argparse.Namespace,
    seconds: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in table:
        curves = [r.curve for r in runs if r.method == row["method"] and r.lr == row["lr"] and r.curve]
        if not curves:
            continue
        steps = [s for s, _ in curves[0]]
        n = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
        ax.plot([0, *steps[:n]], [start_acc, *mean], marker="o", markersize=3, label=row["method"])
    ax.axhline(teacher_acc, color="black", linestyle="--", linewidth=1, label="teacher")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation exact-match accuracy (mean over seeds)")
    ax.set_title("Toy task: 3-digit reversed addition, 2x64 student, 4x128 teacher")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "gkd_accuracy.png", dpi=110)

    machine = getattr(args, "machine", None) or (
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
    command = getattr(args, "command", None) or ("python scripts/reproduce_gkd.py " + " ".join(sys.argv[1:])).strip()
    lines = [
        "# Distillation on the toy task: SFT vs supervised KD vs SeqKD vs on-policy GKD",
        "",
        "Generated by `scripts/reproduce_gkd.py` (do not edit by hand; rerun the script).",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine}; total {seconds / 60:.1f} min",
        "- Task: `lightning_gkd.data.toy.addition_rows` — 3-digit addition, every number written units digit "
        "first; exact match of the greedy answer on the 512-prompt test split.",
        f"- Teacher: 4x128 Qwen2 (`assets/toy/teacher`), test accuracy **{teacher_acc:.3f}**. Student start: 2x64 "
        f"Qwen2 after a brief SFT (`assets/toy/student_init`), test accuracy **{start_acc:.3f}**.",
        f"- Budget: {args.steps} optimizer steps of batch {args.batch_size} for every method, seeds "
        f"{args.seeds}; AdamW with 10% warmup then cosine decay; learning rate per method = best validation "
        f"accuracy over {args.lrs} on the first seed (the generalized JSD's gradients are smaller than the KL "
        "endpoints', so one shared rate would be unfair). Sampling temperature 1.0, loss temperature 1.0, max 8 new "
        "tokens.",
        "",
        "| method | what | lr | test accuracy (mean ± std) | gap closed |",
        "|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['method']} | {row['description']} | {row['lr']:g} | "
            f"{row['mean']:.3f} ± {row['std']:.3f} (n={row['seeds']}) | {row['gap_closed']:.1%} |"
        )
    lines += [
        "",
        "Gap closed = (method − student start) / (teacher − student start).",
        "",
        "![validation accuracy vs step](gkd_accuracy.png)",
        "",
        *verdict(table, runs),
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(
        json.dumps(
            {
                "table": table,
                "runs": [asdict(r) for r in runs],
                "teacher_accuracy": teacher_acc,
                "student_start_accuracy": start_acc,
                "seconds": seconds,
                "machine": machine,
                "command": command.strip(),
                "args": {"steps": args.steps, "batch_size": args.batch_size, "seeds": args.seeds, "lrs": args.lrs},
            },
            indent=2,
        )
    )


def mean_curve(runs: list[Run], method: str, lr: float) -> list[tuple[int, float]]:
    """Validation accuracy per evaluation step, averaged over the seeds run at ``lr``."""
    curves = [r.curve for r in runs if r.method == method and r.lr == lr and r.curve]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [(curves[0][i][0], statistics.fmean(c[i][1] for c in curves)) for i in range(n)]


def verdict(table: list[dict], runs: list[Run]) -> list[str]:
    """Whether on-policy GKD won, computed from the table and curves, and what this task does and does not show."""
    on_policy = [r for r in table if r["method"].startswith("GKD")]
    off_policy = [r for r in table if r["method"] in ("SFT", "Supervised KD", "SeqKD")]
    if not on_policy or not off_policy:
        return []
    best_on = max(on_policy, key=lambda r: r["mean"])
    best_off = max(off_policy, key=lambda r: r["mean"])
    won = best_on["mean"] > best_off["mean"] + best_off["std"]
    lines = [
        "## Reading these numbers",
        "",
        f"Best on-policy method: **{best_on['method']}** {best_on['mean']:.3f} ± {best_on['std']:.3f}; best "
        f"off-policy method: **{best_off['method']}** {best_off['mean']:.3f} ± {best_off['std']:.3f}. "
        + (
            "On-policy GKD wins here by more than one standard deviation."
            if won
            else "**On-policy GKD does not win on this task and budget**: the paper's claim is not reproduced here."
        ),
    ]
    curves = {r["method"]: mean_curve(runs, r["method"], r["lr"]) for r in table}
    middle = min(len(c) for c in curves.values()) // 2 - 1
    if middle >= 0:
        step = next(iter(curves.values()))[middle][0]
        at_middle = {name: c[middle][1] for name, c in curves.items()}
        lead_on = max((n for n in at_middle if n.startswith("GKD") or n.startswith("Mixed")), key=at_middle.get)
        lead_off = max((n for n in at_middle if n in ("SFT", "Supervised KD", "SeqKD")), key=at_middle.get)
        lines += [
            "",
            f"Halfway through the budget (step {step}, validation, mean over seeds) the picture differs: "
            f"{lead_on} {at_middle[lead_on]:.3f} vs {lead_off} {at_middle[lead_off]:.3f}. "
            + (
                "On-policy methods learn faster early on; the off-policy methods, at their larger chosen "
                "learning rate, catch up by the end."
                if at_middle[lead_on] > at_middle[lead_off]
                else "The off-policy methods lead there too."
            ),
        ]
    if not won:
        lines += [
            "",
            "Why, as far as these runs show:",
            "",
            "- The student can learn this task from the ground truth alone: SFT takes it from 46% to about "
            "90% in 200 steps. The teacher is nearly deterministic (98% exact match), so its soft targets "
            "carry little beyond the one-hot answers, and there is little left for distillation to add.",
            "- On-policy sampling (temperature 1) from a student that is wrong on half the prompts spends "
            "much of the budget on wrong prefixes; for β ≥ 0.5 the loss is bounded and its gradients small, "
            "and the larger learning rate that would compensate (3e-3) was worse on validation for those "
            "methods. Reverse-KL-leaning runs (β = 0.9, 1) are also the least stable across seeds.",
            "- Budget changes already tried: a first sweep without warmup (lr 1e-3, 3e-3) was unstable "
            "(3e-3 collapsed every method, reverse KL collapsed one seed at 1e-3); adding 10% warmup and "
            "widening the sweep made every method stable but did not change the ranking.",
            "- What should favour on-policy distillation, to try next: a student that cannot reach the "
            "teacher by SFT (a capacity gap rather than a training gap), longer answers (more room for "
            "compounding errors), and a teacher whose distribution is not one-hot (several acceptable "
            "answers).",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    parser.add_argument("--methods", nargs="+", default=None, help="subset of method names")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true", help="1 seed, 1 lr, 6 steps: a smoke test")
    parser.add_argument(
        "--rerender",
        action="store_true",
        help="rewrite results.md and the plot from <out>/results.json without training",
    )
    args = parser.parse_args(argv)
    if args.rerender:
        saved = json.loads((args.out / "results.json").read_text())
        runs = [Run(**{**r, "curve": [tuple(p) for p in r["curve"]]}) for r in saved["runs"]]
        for key, value in saved["args"].items():
            setattr(args, key, value)
        args.command, args.machine = saved["command"], saved["machine"]
        write_report(
            args.out,
            saved["table"],
            runs,
            teacher_acc=saved["teacher_accuracy"],
            start_acc=saved["student_start_accuracy"],
            args=args,
            seconds=saved["seconds"],
        )
        return 0
    if args.fast:
        args.steps, args.eval_every, args.seeds, args.lrs = 6, 3, args.seeds[:1], args.lrs[:1]
    methods = [m for m in METHODS if args.methods is None or m.name in args.methods]

    started = time.perf_counter()
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    rows = {"train": addition_rows("train"), "val": addition_rows("val"), "test": addition_rows("test")}
    if args.fast:
        rows = {"train": rows["train"][:256], "val": rows["val"][:32], "test": rows["test"][:64]}
    teacher_acc = evaluate_generations(
        load_causal_lm(asset_path("toy/teacher")), tokenizer, rows["test"], max_new_tokens=8
    )["accuracy"]
    start_acc = evaluate_generations(
        load_causal_lm(asset_path("toy/student_init")), tokenizer, rows["test"], max_new_tokens=8
    )["accuracy"]
    print(f"teacher test accuracy {teacher_acc:.3f}, student start {start_acc:.3f}", flush=True)

    runs: list[Run] = []
    work = args.out / ".runs"
    settings = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        tokenizer=tokenizer,
        rows=rows,
        work_dir=work,
    )
    for method in methods:
        sweep = [train_one(method, seed=args.seeds[0], lr=lr, **settings) for lr in args.lrs]
        best = max(sweep, key=lambda r: (r.curve[-1][1] if r.curve else 0.0, -r.lr))
        runs.append(best)
        runs += [train_one(method, seed=seed, lr=best.lr, **settings) for seed in args.seeds[1:]]
        done = [r for r in runs if r.method == method.name]
        print(
            f"{method.name}: lr {best.lr:g} (sweep val {[r.curve[-1][1] if r.curve else None for r in sweep]})"
            f", test {[round(r.test_accuracy, 3) for r in done]}, {sum(r.seconds for r in done):.0f}s",
            flush=True,
        )

    table = summarize(runs, methods, teacher_acc, start_acc)
    write_report(
        args.out,
        table,
        runs,
        teacher_acc=teacher_acc,
        start_acc=start_acc,
        args=args,
        seconds=time.perf_counter() - started,
    )
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
