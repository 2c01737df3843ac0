"""Two teachers on disjoint skills, one student: multi-teacher routing on the toy task.

Skill "add" is the toy addition task (digits units first), taught by the shipped toy teacher, which never saw the
other skill. Skill "reverse" writes a number's digits backwards (``"90417~"`` -> ``"71409"``), taught by a second
teacher of the same size trained here from scratch on it alone (SFT until 97% validation exact match), which never
saw addition. The student (the shipped toy student start) trains on a 50/50 mix of both skills with supervised KD
(λ=0, β=0, forward KL on the ground-truth answers), three ways:

- routed: ``teacher.kind=multi``, each row's ``teacher`` column names its skill's teacher;
- "add" teacher only / "reverse" teacher only: one teacher scores every row.

Reports each skill's held-out exact match per arm (mean over seeds) and the routed run's per-teacher token counts;
writes docs/multi_teacher.md and .json.

    python scripts/multi_teacher_skills.py             # about 5 minutes on 2 CPU cores
    python scripts/multi_teacher_skills.py --fast --out /tmp/multi   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from transformers import get_cosine_schedule_with_warmup

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TOY_TEACHER, asset_path, tiny_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_toy_teacher import sft  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def reverse_rows(split: str, num_rows: int | None = None, seed: int = 99) -> list[dict]:
    """The "reverse" skill: 3- to 5-digit numbers, disjoint fixed-seed splits (test, val, train drawn in turn)."""
    sizes = {"test": 512, "val": 256, "train": 20000}
    if num_rows is not None:
        sizes[split] = num_rows
    numbers = random.Random(seed).sample(range(100, 100000), sum(sizes.values()))
    start = {"test": 0, "val": sizes["test"], "train": sizes["test"] + sizes["val"]}[split]
    rows = []
    for n in numbers[start : start + sizes[split]]:
        answer = str(n)[::-1]
        rows.append(
            {
                "messages": [{"role": "user", "content": f"{n}~"}, {"role": "assistant", "content": answer}],
                "answer": answer,
            }
        )
    return rows


def skill_rows(split: str, per_skill: int | None) -> dict[str, list[dict]]:
    return {"add": addition_rows(split, per_skill), "reverse": reverse_rows(split, per_skill)}


def mixed(rows: dict[str, list[dict]]) -> list[dict]:
    """Both skills interleaved, each row naming its teacher."""
    out = []
    for pair in zip(*(([{**row, "teacher": skill} for row in part]) for skill, part in rows.items()), strict=False):
        out.extend(pair)
    return out


def train_reverse_teacher(tokenizer: Any, steps: int, root: Path) -> torch.nn.Module:
    model = tiny_causal_lm(TOY_TEACHER, tokenizer, seed=0)
    rows = (reverse_rows("train"), reverse_rows("val"))
    sft(model, tokenizer, steps=steps, lr=1e-3, batch_size=64, seed=0, target=0.97, root=root, val_every=100, rows=rows)
    return model.eval()


def distil(teacher: Any, rows: list[dict], val: list[dict], *, seed: int, steps: int, lr: float, root: Path) -> tuple:
    L.seed_everything(seed, workers=True)
    module = GKDModule(
        load_causal_lm(asset_path("toy/student_init")),
        teacher,
        tokenizer := load_tokenizer(asset_path("toy/teacher")),
        lmbda=0.0,
        beta=0.0,
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(get_cosine_schedule_with_warmup, num_warmup_steps=steps // 10, num_training_steps=steps),
        metrics={},
        seed=seed,
    )
    data = ChatDataModule(tokenizer, rows, val, batch_size=32, max_length=64, seed=seed)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        default_root_dir=root,
        log_every_n_steps=1,
    )
    counts: dict[str, float] = {}

    class Counts(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            for key, value in trainer.callback_metrics.items():
                if key.endswith("/tokens"):
                    counts[key] = counts.get(key, 0.0) + float(value)

    trainer.callbacks.append(Counts())  # type: ignore[attr-defined]
    trainer.fit(module, datamodule=data)
    return module.model, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="at 200 the routed student is still half-way")
    parser.add_argument("--teacher-steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args(argv)
    per_skill = None
    if args.fast:
        args.steps, args.teacher_steps, args.seeds, per_skill = 4, 20, args.seeds[:1], 64
    started = time.perf_counter()
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    work = args.out / ".runs" / "multi_teacher"
    teachers = {
        "add": load_causal_lm(asset_path("toy/teacher")),
        "reverse": train_reverse_teacher(tokenizer, args.teacher_steps, work / "reverse_teacher"),
    }
    train, val, test = skill_rows("train", per_skill), skill_rows("val", per_skill), skill_rows("test", per_skill)
    skill_test = {skill: rows[:256] if args.fast else rows for skill, rows in test.items()}

    def accuracy(model: torch.nn.Module) -> dict[str, float]:
        return {
            skill: evaluate_generations(model, tokenizer, rows, max_new_tokens=8)["accuracy"]
            for skill, rows in skill_test.items()
        }

    report: dict[str, Any] = {"teachers": {name: accuracy(model) for name, model in teachers.items()}}
    report["student_start"] = accuracy(load_causal_lm(asset_path("toy/student_init")))
    print(f"teachers {report['teachers']}, student start {report['student_start']}", flush=True)
    arms = {
        "routed (multi)": {
            "kind": "multi",
            "column": "teacher",
            "teachers": {name: {"kind": "local", "model": model} for name, model in teachers.items()},
        },
        '"add" teacher only': teachers["add"],
        '"reverse" teacher only': teachers["reverse"],
    }
    rows, val_rows = mixed(train), mixed(val)
    report["arms"], report["token_counts"] = {}, {}
    for arm, teacher in arms.items():
        scores = []
        for seed in args.seeds:
            model, counts = distil(teacher, rows, val_rows, seed=seed, steps=args.steps, lr=args.lr, root=work / arm)
            scores.append(accuracy(model))
            if counts:
                report["token_counts"][f"seed {seed}"] = counts
        report["arms"][arm] = {skill: [s[skill] for s in scores] for skill in skill_test}
        print(f"{arm}: {report['arms'][arm]}", flush=True)
    report.update(
        command="python scripts/multi_teacher_skills.py" + (" --fast" if args.fast else ""),
        machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        seconds=time.perf_counter() - started,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multi_teacher.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "multi_teacher.md").write_text(render(report))
    print(render(report))
    return 0


def render(report: dict[str, Any]) -> str:
    skills = list(report["student_start"])
    header = " | ".join(f'"{s}" test accuracy' for s in skills)
    lines = [
        "# Two teachers on disjoint skills (toy task, multi-teacher routing)",
        "",
        "Generated by `scripts/multi_teacher_skills.py` (do not edit by hand; rerun the script).",
        "",
        f"- Command: `{report['command']}`; machine: {report['machine']}; total {report['seconds'] / 60:.1f} min",
        f"- Student: the toy student start; {report['args']['steps']} steps of batch 32 over a 50/50 mix of both "
        f"skills, supervised KD (λ=0, β=0), lr {report['args']['lr']}, seeds {report['args']['seeds']}.",
        "",
        f"| | {header} |",
        "|---|" + "---|" * len(skills),
    ]
    for name, scores in report["teachers"].items():
        lines.append(f'| teacher "{name}" | ' + " | ".join(f"{scores[s]:.3f}" for s in skills) + " |")
    lines.append("| student start | " + " | ".join(f"{report['student_start'][s]:.3f}" for s in skills) + " |")
    for arm, scores in report["arms"].items():
        cells = []
        for skill in skills:
            values = scores[skill]
            spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.3f}{spread}")
        lines.append(f"| student, {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Routed run, supervised tokens each teacher scored (summed over steps):", ""]
    for seed, counts in report["token_counts"].items():
        lines.append(f"- {seed}: " + ", ".join(f"{k}: {int(v)}" for k, v in sorted(counts.items())))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
