"""Make the toy agentic task's assets: a BPE tokenizer learned on its tool transcripts, a teacher trained (SFT,
every assistant turn) to act with the tools, and a smaller student given a brief SFT so it starts well below the
teacher. Writes lightning_gkd/assets/toy_tools/{teacher,student_init} and a manifest.

    python scripts/train_toy_tools.py --threads 2

Success is measured the way the task is used: greedy multi-turn rollouts with the task's tools (lookup, add) on
held-out rows; a row succeeds when the transcript's last assistant message is the right sum. The teacher must reach
--required on the test split, else the script exits non-zero."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
from transformers import get_cosine_schedule_with_warmup

from lightning_gkd import ChatDataModule
from lightning_gkd.cli.compose import build_method
from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_bpe_tokenizer, load_tokenizer
from lightning_gkd.evaluation.metrics import exact_match
from lightning_gkd.rollouts import build_environment
from lightning_gkd.rollouts.evaluate import final_answers, rollout_rows
from lightning_gkd.studies.step_timing import plain_trainer
from lightning_gkd.toy.tiny import TOOLS_STUDENT, TOOLS_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tools import MAX_NEW_TOKENS, MAX_TRANSCRIPT_TOKENS, TOOLS, task_rollout, tool_rows

ASSETS = Path(__file__).resolve().parents[1] / "lightning_gkd" / "assets" / "toy_tools"
MAX_LENGTH = MAX_TRANSCRIPT_TOKENS


def build_tokenizer(merges: int):
    """Byte-level BPE learned on the training transcripts (tools rendered), plus the call markers as added tokens
    (as Qwen2.5's tokenizer has them), with the tool-rendering ChatML template."""
    plain = build_chatml_bpe_tokenizer([], merges=0)
    plain.chat_template = TOOLS_CHATML_TEMPLATE
    _, schemas = build_environment(list(TOOLS), None, plain, timeout=5)
    corpus = [plain.apply_chat_template(r["messages"], tools=schemas, tokenize=False) for r in tool_rows("train")]
    tokenizer = build_chatml_bpe_tokenizer(corpus, merges=merges)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    return tokenizer


def success(model, tokenizer, rows) -> float:
    transcripts, _ = rollout_rows(model, tokenizer, rows, task_rollout(tokenizer), max_new_tokens=MAX_NEW_TOKENS)
    return exact_match(final_answers(transcripts), [row["answer"] for row in rows])


class RolloutValidation(L.Callback):
    """Every ``every`` steps: greedy rollout success on ``rows``; stops training once it reaches ``target``."""

    def __init__(self, rows, every: int, target: float | None, start: int = 0) -> None:
        self.rows, self.every, self.target, self.start = rows, every, target, start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every or trainer.global_step < self.start:
            return
        score = success(pl_module.model, pl_module.tokenizer, self.rows)
        print(f"step {trainer.global_step}: val success {score:.4f}", flush=True)
        if self.target is not None and score >= self.target:
            trainer.should_stop = True


def sft(
    model, tokenizer, *, steps: int, lr: float, batch_size: int, seed: int, target: float, every: int, root, start=0
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
        tokenizer, tool_rows("train"), batch_size=batch_size, max_length=MAX_LENGTH, seed=seed, assistant_turns="all"
    )
    _, schemas = build_environment(list(TOOLS), None, tokenizer, timeout=5)
    data.use_rollouts(schemas)
    validation = RolloutValidation(tool_rows("val")[:128], every, target, start)
    trainer = plain_trainer(steps, callbacks=[validation], default_root_dir=root)
    trainer.fit(module, datamodule=data)
    return module


def make_student(args, tokenizer, test):
    """The student's start: a brief SFT stopped once its validation success passes --student-target."""
    student = sft(
        tiny_causal_lm(TOOLS_STUDENT, tokenizer, seed=args.seed + 1),
        tokenizer,
        steps=args.student_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed + 1,
        target=args.student_target,
        every=args.student_every,
        start=args.student_eval_from,
        root=args.out.parent / ".train_tools_student",
    )
    student_success = success(student.model, tokenizer, test)
    print(f"student start: {student.global_step} steps, test success {student_success:.4f}", flush=True)
    return student, student_success


def student_entry(args, student, student_success) -> dict:
    return {
        "config": TOOLS_STUDENT,
        "sft_steps": student.global_step,
        "schedule_steps": args.student_steps,
        "validated": f"every {args.student_every} steps from {args.student_eval_from}, target {args.student_target}",
        "test_success": student_success,
    }


def remake_student(args, test, started: float) -> int:
    """--reuse-teacher: a new student start beside the teacher already in --out; the manifest's other entries kept."""
    manifest = json.loads((args.out / "manifest.json").read_text())
    tokenizer = load_tokenizer(args.out / "teacher")
    student, student_success = make_student(args, tokenizer, test)
    student.export(args.out / "student_init")
    manifest["student_init"] = student_entry(args, student, student_success)
    manifest["student_command"] = "python scripts/train_toy_tools.py " + " ".join(sys.argv[1:])
    manifest["student_seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--merges", type=int, default=200)
    parser.add_argument("--teacher-steps", type=int, default=3000)
    parser.add_argument("--student-steps", type=int, default=2000, help="length of the student's LR schedule")
    parser.add_argument("--student-target", type=float, default=0.2)
    parser.add_argument("--student-every", type=int, default=10, help="student validation every this many steps")
    parser.add_argument("--student-eval-from", type=int, default=600, help="first step the student is validated")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    test = tool_rows("test")
    if args.reuse_teacher:
        return remake_student(args, test, started)
    tokenizer = build_tokenizer(args.merges)
    print(f"tokenizer: {len(tokenizer)} tokens", flush=True)
    teacher = sft(
        tiny_causal_lm(TOOLS_TEACHER, tokenizer, seed=args.seed),
        tokenizer,
        steps=args.teacher_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        target=args.target,
        every=250,
        root=args.out.parent / ".train_tools_teacher",
    )
    teacher_success = success(teacher.model, tokenizer, test)
    print(f"teacher: {teacher.global_step} steps, test success {teacher_success:.4f}", flush=True)
    if teacher_success < args.required:
        print(f"teacher test success {teacher_success:.4f} < {args.required}; raise --teacher-steps", file=sys.stderr)
        return 1
    student, student_success = make_student(args, tokenizer, test)
    args.out.mkdir(parents=True, exist_ok=True)
    teacher.export(args.out / "teacher")
    student.export(args.out / "student_init")
    manifest = {
        "task": "lightning_gkd.toy.tools (sum of two of a row's facts, read with lookup and added with add: "
        "three tool calls, then the answer; success = the last assistant message is the sum)",
        "tokenizer": {
            "builder": "lightning_gkd.data.tokenizer.build_chatml_bpe_tokenizer on the training transcripts, plus "
            "<tool_call> and </tool_call> as added tokens; chat template TOOLS_CHATML_TEMPLATE",
            "merges": args.merges,
            "vocabulary_size": len(tokenizer),
        },
        "teacher": {"config": TOOLS_TEACHER, "sft_steps": teacher.global_step, "test_success": teacher_success},
        "student_init": student_entry(args, student, student_success),
        "evaluation": f"greedy rollouts, max_tool_calling_iterations=4, {MAX_NEW_TOKENS} new tokens a turn, "
        f"{len(test)} test rows",
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
