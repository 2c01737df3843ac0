"""Make a toy agentic task's assets: a BPE tokenizer learned on its tool transcripts, a teacher trained (SFT) to act
with the tools, and a smaller student given a brief SFT on the clean transcripts so it starts well below the
teacher. Writes lightning_gkd/assets/<task's folder>/{teacher,student_init} and a manifest.

    python scripts/train_toy_tools.py --threads 2                    # toy_tools (lightning_gkd.toy.tools)
    python scripts/train_toy_tools.py --task recovery --threads 2    # toy_recovery (lightning_gkd.toy.recovery)

The recovery task's teacher also trains on error->retry episodes (``lightning_gkd.toy.recovery.teacher_rows``: the
injected miscopies are context, never labels); its student start sees the clean transcripts only.

Success is measured the way the task is used: greedy multi-turn rollouts with the task's tools on held-out rows; a
row succeeds when the transcript's last assistant message is the row's answer. The teacher must reach --required on
the test split, else the script exits non-zero."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from transformers import get_cosine_schedule_with_warmup

from lightning_gkd import ChatDataModule
from lightning_gkd.cli.compose import build_method
from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_bpe_tokenizer, load_tokenizer
from lightning_gkd.evaluation.metrics import exact_match
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.rollouts import build_environment
from lightning_gkd.rollouts.evaluate import final_answers, rollout_rows
from lightning_gkd.studies.step_timing import plain_trainer
from lightning_gkd.toy import recovery, tools
from lightning_gkd.toy.tiny import (
    PACKAGE_ASSETS,
    RECOVERY_STUDENT,
    RECOVERY_TEACHER,
    TOOLS_STUDENT,
    TOOLS_TEACHER,
    asset_path,
    tiny_causal_lm,
)


@dataclass(frozen=True)
class AssetTask:
    """What the script trains for one task: its module's rows, tools and rollout, the teacher's training rows (and
    which of their assistant turns are labels), the model shapes, the folder and the defaults of its options."""

    folder: str
    description: str
    tools: tuple[str, ...]
    rows: Callable[[str], list[dict[str, Any]]]
    teacher_rows: Callable[[], list[dict[str, Any]]]
    teacher_turns: str
    teacher_collator: Callable[[Any], Any] | None
    rollout: Callable[[Any], Any]
    max_new_tokens: int
    max_length: int
    iterations: int
    teacher_config: dict[str, Any]
    student_config: dict[str, Any]
    defaults: dict[str, Any]
    #: an asset folder whose tokenizer the task reuses and whose teacher and student_init its models start from
    init_from: str | None = None


TASKS = {
    "tools": AssetTask(
        folder="toy_tools",
        description="lightning_gkd.toy.tools (sum of two of a row's facts, read with lookup and added with add: "
        "three tool calls, then the answer; success = the last assistant message is the sum)",
        tools=tools.TOOLS,
        rows=tools.tool_rows,
        teacher_rows=lambda: tools.tool_rows("train"),
        teacher_turns="all",
        teacher_collator=None,
        rollout=tools.task_rollout,
        max_new_tokens=tools.MAX_NEW_TOKENS,
        max_length=tools.MAX_TRANSCRIPT_TOKENS,
        iterations=tools.MAX_TOOL_CALLING_ITERATIONS,
        teacher_config=TOOLS_TEACHER,
        student_config=TOOLS_STUDENT,
        defaults={"teacher_steps": 3000, "teacher_every": 250, "student_target": 0.2, "student_eval_from": 600},
    ),
    "recovery": AssetTask(
        folder="toy_recovery",
        description="lightning_gkd.toy.recovery (a 4-letter key leads through a row's directory, read with lookup, "
        "to another key and then a number: two calls copying keys, then the answer; a miscopied key is a tool error "
        "the agent must recover from by calling again; success = the last assistant message is the number)",
        tools=recovery.TOOLS,
        rows=recovery.recovery_rows,
        teacher_rows=lambda: recovery.teacher_rows(20000),
        teacher_turns="all",
        teacher_collator=recovery.MistakeMasking,
        rollout=recovery.task_rollout,
        max_new_tokens=recovery.MAX_NEW_TOKENS,
        max_length=recovery.MAX_TRANSCRIPT_TOKENS,
        iterations=recovery.MAX_TOOL_CALLING_ITERATIONS,
        teacher_config=RECOVERY_TEACHER,
        student_config=RECOVERY_STUDENT,
        defaults={"teacher_steps": 600, "teacher_every": 50, "student_target": 0.3, "student_eval_from": 20},
        init_from="toy_tools",
    ),
}


def build_tokenizer(task: AssetTask, merges: int) -> Any:
    """The tokenizer of ``task.init_from``'s teacher where the task starts from other assets; else byte-level BPE
    learned on the teacher's training transcripts (tools rendered), plus the call markers as added tokens (as
    Qwen2.5's tokenizer has them), with the tool-rendering ChatML template. Returns the tokenizer."""
    if task.init_from is not None:
        return load_tokenizer(asset_path(f"{task.init_from}/teacher"))
    plain = build_chatml_bpe_tokenizer([], merges=0)
    plain.chat_template = TOOLS_CHATML_TEMPLATE
    _, schemas = build_environment(list(task.tools), None, plain, timeout=5)
    whole = [r for r in task.teacher_rows() if not str(r["messages"][-1]["content"]).startswith("<tool_call>")]
    corpus = [plain.apply_chat_template(r["messages"], tools=schemas, tokenize=False) for r in whole]
    tokenizer = build_chatml_bpe_tokenizer(corpus, merges=merges)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    return tokenizer


def initial_model(task: AssetTask, tokenizer: Any, role: str, seed: int) -> Any:
    """The model ``role`` ("teacher" or "student_init") starts from: ``task.init_from``'s (its context length set to
    the task's; RoPE has no weights for it), else a random one of the task's shape. Returns the model."""
    config = task.teacher_config if role == "teacher" else task.student_config
    if task.init_from is None:
        return tiny_causal_lm(config, tokenizer, seed=seed)
    model = load_causal_lm(asset_path(f"{task.init_from}/{role}"))
    model.config.max_position_embeddings = config["max_position_embeddings"]
    return model


def success(task: AssetTask, model, tokenizer, rows) -> float:
    """Greedy rollouts of ``rows`` with the task's tools: the share whose final answer is the row's answer."""
    rollout = task.rollout(tokenizer)
    transcripts, _ = rollout_rows(model, tokenizer, rows, rollout, max_new_tokens=task.max_new_tokens)
    return exact_match(final_answers(transcripts), [row["answer"] for row in rows])


class RolloutValidation(L.Callback):
    """Every ``every`` steps: greedy rollout success on ``rows``; stops training once it reaches ``target``."""

    def __init__(self, task: AssetTask, rows, every: int, target: float | None, start: int = 0) -> None:
        self.task, self.rows, self.every, self.target, self.start = task, rows, every, target, start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every or trainer.global_step < self.start:
            return
        score = success(self.task, pl_module.model, pl_module.tokenizer, self.rows)
        print(f"step {trainer.global_step}: val success {score:.4f}", flush=True)
        if self.target is not None and score >= self.target:
            trainer.should_stop = True


def sft(
    task: AssetTask,
    model,
    tokenizer,
    rows,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    target: float,
    every: int,
    root,
    start=0,
    assistant_turns: str = "all",
    collator: Callable[[Any], Any] | None = None,
):
    L.seed_everything(seed, workers=True)
    module = build_method(
        ["method=sft", f"seed={seed}"],
        model=model,
        tokenizer=tokenizer,
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=min(100, steps // 10), num_training_steps=steps
        ),
    )
    data = ChatDataModule(
        tokenizer, rows, batch_size=batch_size, max_length=task.max_length, seed=seed, assistant_turns=assistant_turns
    )
    _, schemas = build_environment(list(task.tools), None, tokenizer, timeout=5)
    data.use_rollouts(schemas)
    if collator is not None:  # e.g. the recovery teacher's: its injected miscopies are never labels
        data.collator = collator(data.collator)
    validation = RolloutValidation(task, task.rows("val")[:128], every, target, start)
    trainer = plain_trainer(steps, callbacks=[validation], default_root_dir=root)
    trainer.fit(module, datamodule=data)
    return module


def make_student(args, task: AssetTask, tokenizer, test):
    """The student's start: a brief SFT on the clean transcripts stopped once its validation success passes
    --student-target."""
    student = sft(
        task,
        initial_model(task, tokenizer, "student_init", args.seed + 1),
        tokenizer,
        task.rows("train"),
        steps=args.student_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed + 1,
        target=args.student_target,
        every=args.student_every,
        start=args.student_eval_from,
        root=args.out.parent / f".train_{task.folder}_student",
    )
    student_success = success(task, student.model, tokenizer, test)
    print(f"student start: {student.global_step} steps, test success {student_success:.4f}", flush=True)
    return student, student_success


def student_entry(args, task: AssetTask, student, student_success) -> dict:
    return {
        "config": task.student_config,
        "initialised_from": f"assets/{task.init_from}/student_init" if task.init_from else "random",
        "sft_steps": student.global_step,
        "schedule_steps": args.student_steps,
        "validated": f"every {args.student_every} steps from {args.student_eval_from}, target {args.student_target}",
        "test_success": student_success,
    }


def remake_student(args, task: AssetTask, test, started: float) -> int:
    """--reuse-teacher: a new student start beside the teacher already in --out; the manifest's other entries kept."""
    manifest = json.loads((args.out / "manifest.json").read_text())
    tokenizer = load_tokenizer(args.out / "teacher")
    student, student_success = make_student(args, task, tokenizer, test)
    student.export(args.out / "student_init")
    manifest["student_init"] = student_entry(args, task, student, student_success)
    manifest["student_command"] = "python scripts/train_toy_tools.py " + " ".join(sys.argv[1:])
    manifest["student_seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="tools")
    parser.add_argument("--out", type=Path, default=None, help="default: lightning_gkd/assets/<the task's folder>")
    parser.add_argument("--merges", type=int, default=200)
    parser.add_argument("--teacher-steps", type=int, default=None, help="default: tools 3000, recovery 1000")
    parser.add_argument(
        "--teacher-every", type=int, default=None, help="teacher validation every N steps (tools 250, recovery 100)"
    )
    parser.add_argument("--student-steps", type=int, default=2000, help="length of the student's LR schedule")
    parser.add_argument("--student-target", type=float, default=None, help="default: tools 0.2, recovery 0.3")
    parser.add_argument("--student-every", type=int, default=10, help="student validation every this many steps")
    parser.add_argument(
        "--student-eval-from", type=int, default=None, help="first student validation step (tools 600, recovery 100)"
    )
    parser.add_argument(
        "--reuse-teacher",
        action="store_true",
        help="keep the teacher in --out (and its manifest entry); remake the student",
    )
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--required", type=float, default=0.95)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    task = TASKS[args.task]
    for name, value in task.defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.out = args.out or PACKAGE_ASSETS / task.folder
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    test = task.rows("test")
    if args.reuse_teacher:
        return remake_student(args, task, test, started)
    tokenizer = build_tokenizer(task, args.merges)
    print(f"tokenizer: {len(tokenizer)} tokens", flush=True)
    teacher = sft(
        task,
        initial_model(task, tokenizer, "teacher", args.seed),
        tokenizer,
        task.teacher_rows(),
        steps=args.teacher_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        target=args.target,
        every=args.teacher_every,
        root=args.out.parent / f".train_{task.folder}_teacher",
        assistant_turns=task.teacher_turns,
        collator=task.teacher_collator,
    )
    teacher_success = success(task, teacher.model, tokenizer, test)
    print(f"teacher: {teacher.global_step} steps, test success {teacher_success:.4f}", flush=True)
    if teacher_success < args.required:
        print(f"teacher test success {teacher_success:.4f} < {args.required}; raise --teacher-steps", file=sys.stderr)
        return 1
    student, student_success = make_student(args, task, tokenizer, test)
    args.out.mkdir(parents=True, exist_ok=True)
    teacher.export(args.out / "teacher")
    student.export(args.out / "student_init")
    manifest = {
        "task": task.description,
        "tokenizer": {
            "builder": "lightning_gkd.data.tokenizer.build_chatml_bpe_tokenizer on the training transcripts, plus "
            "<tool_call> and </tool_call> as added tokens; chat template TOOLS_CHATML_TEMPLATE",
            "merges": args.merges,
            "vocabulary_size": len(tokenizer),
        }
        if task.init_from is None
        else {"reused": f"assets/{task.init_from}/teacher's", "vocabulary_size": len(tokenizer)},
        "teacher": {
            "config": task.teacher_config,
            "initialised_from": f"assets/{task.init_from}/teacher" if task.init_from else "random",
            "sft_steps": teacher.global_step,
            "training_rows": "every assistant turn of the training transcripts"
            if task.teacher_turns == "all"
            else "lightning_gkd.toy.recovery.teacher_rows(20000): the training transcripts, 40% of them with injected "
            "miscopies followed by the error and the correct retry; every assistant turn labelled but the miscopies "
            "(recovery.MistakeMasking)",
            "test_success": teacher_success,
        },
        "student_init": student_entry(args, task, student, student_success),
        "evaluation": f"greedy rollouts, max_tool_calling_iterations={task.iterations}, {task.max_new_tokens} new "
        f"tokens a turn, {len(test)} test rows",
        "training": {
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "schedule": "cosine with warmup",
            "seconds": round(time.perf_counter() - started, 1),
        },
        "command": "python scripts/train_toy_tools.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
