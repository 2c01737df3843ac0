"""Two teachers on disjoint skills, one student: multi-teacher routing on the toy task.

Skill "add" is the toy addition task (digits units first), taught by the shipped toy teacher, which never saw the
other skill. Skill "reverse" writes a number's digits backwards (``"90417~"`` -> ``"71409"``), taught by a second
teacher of the same size trained here from scratch on it alone (SFT until 97% validation exact match), which never
saw addition. The student (the shipped toy student start) trains on a 50/50 mix of both skills with supervised KD
(the addition study's ``recipe=supervised_kd``: λ=0, β=0, forward KL on the ground-truth answers), three ways:

- routed: ``teacher.kind=multi``, each row's ``teacher`` column names its skill's teacher;
- "add" teacher only / "reverse" teacher only: one teacher scores every row.

Reports each skill's held-out exact match per arm (mean over seeds) and the routed run's per-teacher token counts;
writes docs/multi_teacher.md and .json.

    python scripts/multi_teacher_skills.py             # about 5 minutes on 2 CPU cores
    python scripts/multi_teacher_skills.py --fast --out /tmp/multi   # a smoke test
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_gkd.cli.compose import train
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.studies.reports import generated_by, write_report
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TOY_TEACHER, asset_path, tiny_causal_lm

REPO = Path(__file__).resolve().parents[1]
#: every run's data and rows: chat rows from .jsonl files, 64 tokens at most, validation on the whole split
DATA = ["data=chat_files", "data.max_length=64", "+data.val_batch_size=256"]


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


def write_rows(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def train_reverse_teacher(tokenizer: Any, steps: int, work: Path) -> str:
    """The "reverse" teacher: a toy-teacher-shaped model from random weights (seed 0), SFT (``method=sft``) on the
    skill's rows until 97% validation exact match (EarlyStopping), exported; its folder."""
    start = work / "reverse_init"
    tiny_causal_lm(TOY_TEACHER, tokenizer, seed=0).save_pretrained(start)
    tokenizer.save_pretrained(start)
    rows = [
        f"data.train_data={write_rows(work / 'reverse_train.jsonl', reverse_rows('train'))}",
        f"data.val_data={write_rows(work / 'reverse_val.jsonl', reverse_rows('val'))}",
    ]
    early_stop = {
        "_target_": "lightning.pytorch.callbacks.EarlyStopping",
        "monitor": "val/accuracy",
        "mode": "max",
        "stopping_threshold": 0.97,
        "patience": 10**6,
        "check_on_train_epoch_end": "false",
    }
    result = train(
        [
            "method=sft",
            f"model.student.name_or_path={start}",
            *DATA,
            *rows,
            "data.batch_size=64",
            "optimizer.lr=1e-3",
            "optimizer.weight_decay=0.01",
            "optimizer.fused=false",
            f"scheduler.num_warmup_steps={min(100, steps // 10)}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={min(100, steps)}",
            "trainer.limit_val_batches=null",
            "callbacks=none",
            *[f"+callbacks.early_stop.{key}={value}" for key, value in early_stop.items()],
            "seed=0",
        ],
        output_dir=work / "reverse_teacher",
    )
    return str(result["student_dir"])


def distil(teacher: list[str], rows: list[str], *, seed: int, steps: int, lr: float, out: Path) -> tuple[str, dict]:
    """Supervised KD of the toy student (the addition study's ``supervised_kd`` recipe) from ``teacher`` (overrides)
    on ``rows``: the exported student's folder and each teacher's supervised tokens, summed over the steps."""
    result = train(
        [
            "experiment=study_addition",
            "recipe=supervised_kd",
            *DATA,
            *rows,
            *teacher,
            "data.batch_size=32",
            f"optimizer.lr={lr}",
            f"trainer.max_steps={steps}",
            "trainer.limit_val_batches=0",
            "trainer.log_every_n_steps=1",
            "~callbacks.study_record",
            "callbacks.held_out_eval=null",
            "export=true",
            f"seed={seed}",
        ],
        output_dir=out,
    )
    with open(out / "logs" / "metrics.csv", newline="") as handle:
        logged = list(csv.DictReader(handle))
    counts = {
        key: sum(float(row[key]) for row in logged if row.get(key))
        for key in (logged[0] if logged else {})
        if key.startswith("train/teacher/") and key.endswith("/tokens")
    }
    return str(result["student_dir"]), counts


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
    folders = {
        "add": asset_path("toy/teacher"),
        "reverse": train_reverse_teacher(tokenizer, args.teacher_steps, work),
    }
    train_rows, val = skill_rows("train", per_skill), skill_rows("val", per_skill)
    skill_test = {skill: rows[:256] if args.fast else rows for skill, rows in skill_rows("test", per_skill).items()}

    def accuracy(folder: str) -> dict[str, float]:
        model = load_causal_lm(folder)
        return {
            skill: evaluate_generations(model, tokenizer, rows, max_new_tokens=8)["accuracy"]
            for skill, rows in skill_test.items()
        }

    report: dict[str, Any] = {"teachers": {name: accuracy(folder) for name, folder in folders.items()}}
    report["student_start"] = accuracy(asset_path("toy/student_init"))
    print(f"teachers {report['teachers']}, student start {report['student_start']}", flush=True)
    routed = ["teacher=multi", "~teacher.teachers.default"]
    for name, folder in folders.items():
        routed += [f"+teacher.teachers.{name}.kind=local", f"+teacher.teachers.{name}.model={folder}"]
    arms = {
        "routed (multi)": routed,
        '"add" teacher only': [f"model.teacher.name_or_path={folders['add']}"],
        '"reverse" teacher only': [f"model.teacher.name_or_path={folders['reverse']}"],
    }
    rows = [
        f"data.train_data={write_rows(work / 'mixed_train.jsonl', mixed(train_rows))}",
        f"data.val_data={write_rows(work / 'mixed_val.jsonl', mixed(val))}",
    ]
    report["arms"], report["token_counts"] = {}, {}
    for index, (arm, teacher) in enumerate(arms.items()):
        scores = []
        for seed in args.seeds:
            out = work / f"arm{index}" / f"seed{seed}"
            student, counts = distil(teacher, rows, seed=seed, steps=args.steps, lr=args.lr, out=out)
            scores.append(accuracy(student))
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
    write_report(args.out / "multi_teacher.md", render(report), report)
    print(render(report))
    return 0


def render(report: dict[str, Any]) -> str:
    skills = list(report["student_start"])
    header = " | ".join(f'"{s}" test accuracy' for s in skills)
    lines = [
        "# Two teachers on disjoint skills (toy task, multi-teacher routing)",
        "",
        generated_by("scripts/multi_teacher_skills.py"),
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
