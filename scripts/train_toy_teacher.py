"""Train a toy task's teacher with SFTModule, make the student's starting point, and save both as package
assets (save_pretrained + tokenizer) under lightning_gkd/assets/<task assets>/.

    python scripts/train_toy_teacher.py                 # writes lightning_gkd/assets/toy/{teacher,student_init}
    python scripts/train_toy_teacher.py --task chain    # writes lightning_gkd/assets/toy_chain/...
    python scripts/train_toy_teacher.py --tokenizer bpe # writes lightning_gkd/assets/toy_bpe/teacher only

The teacher is trained until its validation exact-match reaches --target (early stop) and must reach it on the
test split, else the script exits non-zero. The student is a smaller model given a brief SFT that stops
once its validation accuracy passes --student-target, so it starts well below the teacher. Both are deterministic
for a given --seed on one machine.

--tokenizer bpe trains only a teacher, over a byte-level BPE tokenizer whose --merges are learned on the chat text
of the task's training rows (numbers and template words become tokens): a teacher for cross-tokenizer
distillation of the shipped byte-tokenizer student (assets/<task>/student_init, unchanged). Its manifest also
records how the two tokenizers pair up (shared tokens, tokens per answer).
"""

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
from lightning.pytorch.callbacks import EarlyStopping
from transformers import get_cosine_schedule_with_warmup

from lightning_gkd import ChatDataModule
from lightning_gkd.cli.compose import build_method
from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer, build_chatml_tokenizer, load_tokenizer
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.studies.step_timing import plain_trainer
from lightning_gkd.toy.bpe import BPE_MERGES, tokenizer_pairing, training_corpus
from lightning_gkd.toy.tasks import TOY_TASKS, ToyTask, toy_task
from lightning_gkd.toy.tiny import tiny_causal_lm

ASSETS = Path(__file__).resolve().parents[1] / "lightning_gkd" / "assets"


class PrintValidation(L.Callback):
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"step {trainer.global_step}: {metrics}", flush=True)


def sft(
    model,
    tokenizer,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    target: float | None,
    root: Path,
    val_every: int = 250,
    rows: tuple[list[dict], list[dict]] | None = None,
    task: ToyTask = TOY_TASKS["addition"],
) -> L.LightningModule:
    """SFT ``model`` on the toy ``task`` (default addition), or on ``rows`` = (train, val) when given."""
    L.seed_everything(seed, workers=True)
    module = build_method(
        ["method=sft", f"method.validation.max_new_tokens={task.max_new_tokens}", f"seed={seed}"],
        model=model,
        tokenizer=tokenizer,
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=min(100, steps // 10), num_training_steps=steps
        ),
        metrics={"accuracy": task.metric},
    )
    data = ChatDataModule(
        tokenizer,
        *(rows or (task.rows("train"), task.rows("val"))),
        batch_size=batch_size,
        val_batch_size=256,
        max_length=task.max_length,
        seed=seed,
    )
    callbacks: list[L.Callback] = [PrintValidation()]
    if target is not None:
        callbacks.append(
            EarlyStopping(
                "val/accuracy", mode="max", stopping_threshold=target, patience=10**6, check_on_train_epoch_end=False
            )
        )
    validation = {
        "limit_val_batches": 1.0,
        "val_check_interval": min(val_every, steps),
        "check_val_every_n_epoch": None,
    }
    trainer = plain_trainer(steps, callbacks=callbacks, default_root_dir=root, **validation)
    trainer.fit(module, datamodule=data)
    return module


def teacher_rows(task: ToyTask, train_rows: int | None) -> tuple[list[dict], list[dict]] | None:
    """The teacher's (train, val) rows: None (the task's splits) unless ``train_rows`` asks for another train size
    (the held-out splits never change with it)."""
    return None if train_rows is None else (task.rows("train", train_rows), task.rows("val"))


def initial_model(folder: Path | None, config: dict, tokenizer, *, seed: int) -> torch.nn.Module:
    """Random weights of shape ``config``, or the model in ``folder`` (which must have that shape) with room for
    ``config``'s positions (RoPE: no position table to grow)."""
    if folder is None:
        return tiny_causal_lm(config, tokenizer, seed=seed)
    model = load_causal_lm(str(folder))
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size"):
        if getattr(model.config, key) != config[key]:
            raise ValueError(f"{folder}: {key}={getattr(model.config, key)}, the task's models have {config[key]}.")
    if model.config.vocab_size != len(tokenizer):
        raise ValueError(
            f"{folder}: vocab_size={model.config.vocab_size}, the tokenizer has {len(tokenizer)} tokens; start from a "
            "model trained with the same --tokenizer."
        )
    model.config.max_position_embeddings = config["max_position_embeddings"]
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TOY_TASKS), default="addition")
    parser.add_argument("--out", type=Path, default=None, help="default: lightning_gkd/assets/<the task's assets>")
    parser.add_argument("--teacher-steps", type=int, default=6000)
    parser.add_argument("--student-steps", type=int, default=1500, help="length of the student's LR schedule")
    parser.add_argument(
        "--student-target",
        type=float,
        default=0.25,
        help="student val accuracy at which its brief SFT stops (checked every 50 steps)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=0.97, help="teacher val accuracy that stops training")
    parser.add_argument("--required", type=float, default=0.95, help="teacher test accuracy the script demands")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reuse-teacher",
        action="store_true",
        help="keep the teacher already in --out (its manifest entry too) and only remake the student",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--teacher-init",
        type=Path,
        default=None,
        help="start the teacher from this model folder (e.g. the addition teacher) instead of random weights",
    )
    parser.add_argument("--student-init", type=Path, default=None, help="the same for the student")
    parser.add_argument(
        "--train-rows", type=int, default=None, help="training rows for the teacher (default: the task's train split)"
    )
    parser.add_argument(
        "--tokenizer",
        choices=["byte", "bpe"],
        default="byte",
        help="byte: the project's one-token-per-byte tokenizer, teacher and student; bpe: a teacher only, over a "
        "BPE tokenizer learned on the task's training text, written to lightning_gkd/assets/<task assets>_bpe",
    )
    parser.add_argument(
        "--merges", type=int, default=BPE_MERGES, help="BPE merges to learn (--tokenizer bpe; fewer if rarer)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = toy_task(args.task)
    if args.tokenizer == "bpe":
        if args.reuse_teacher:
            parser.error("--reuse-teacher remakes the student; --tokenizer bpe makes no student (drop one of them).")
        return train_bpe_teacher(args, task)
    args.out = args.out or ASSETS / task.assets

    tokenizer = build_chatml_tokenizer()
    test_rows = task.rows("test")
    started = time.perf_counter()
    previous = json.loads((args.out / "manifest.json").read_text()) if args.reuse_teacher else None
    if previous:
        teacher_model = load_causal_lm(str(args.out / "teacher"))
        teacher_steps = previous["teacher"]["sft_steps"]
    else:
        teacher = sft(
            initial_model(args.teacher_init, task.teacher_config, tokenizer, seed=args.seed),
            tokenizer,
            steps=args.teacher_steps,
            lr=args.lr,
            batch_size=args.batch_size,
            seed=args.seed,
            target=args.target,
            root=args.out.parent / ".train_teacher",
            task=task,
            rows=teacher_rows(task, args.train_rows),
        )
        teacher_model, teacher_steps = teacher.model, teacher.global_step
    score = dict(metrics={"accuracy": task.metric}, max_new_tokens=task.max_new_tokens, max_length=task.max_length)
    teacher_acc = evaluate_generations(teacher_model, tokenizer, test_rows, **score)["accuracy"]
    print(f"teacher: {teacher_steps} steps, test accuracy {teacher_acc:.4f}")
    if teacher_acc < args.required:
        print(
            f"teacher test accuracy {teacher_acc:.4f} < required {args.required}; raise --teacher-steps",
            file=sys.stderr,
        )
        return 1
    student = sft(
        initial_model(args.student_init, task.student_config, tokenizer, seed=args.seed + 1),
        tokenizer,
        steps=args.student_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed + 1,
        target=args.student_target,
        root=args.out.parent / ".train_student",
        val_every=50,
        task=task,
    )
    student_acc = evaluate_generations(student.model, tokenizer, test_rows, **score)["accuracy"]
    print(f"student start: {student.global_step} SFT steps, test accuracy {student_acc:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    if not previous:
        teacher.export(args.out / "teacher")
    student.export(args.out / "student_init")
    manifest = {
        "task": f"lightning_gkd.toy.tasks.TOY_TASKS[{task.name!r}] ({task.description})",
        "teacher": {
            "config": task.teacher_config,
            "initialised_from": str(args.teacher_init) if args.teacher_init else "random",
            "sft_steps": teacher_steps,
            "test_accuracy": teacher_acc,
        },
        "student_init": {
            "config": task.student_config,
            "initialised_from": str(args.student_init) if args.student_init else "random",
            "sft_steps": student.global_step,
            "schedule_steps": args.student_steps,
            "test_accuracy": student_acc,
        },
        "training": {
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "schedule": "cosine with warmup",
            "seconds": round(time.perf_counter() - started, 1),
        },
        "command": "python scripts/train_toy_teacher.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


def train_bpe_teacher(args: argparse.Namespace, task: ToyTask) -> int:
    """Train ``task``'s teacher over a BPE tokenizer learned on its training text and write it, with a manifest,
    to ``args.out`` (default ``assets/<task assets>_bpe``)/teacher; the student start stays the byte one."""
    out = args.out or ASSETS / f"{task.assets}_bpe"
    started = time.perf_counter()
    tokenizer = build_chatml_bpe_tokenizer(training_corpus(task), merges=args.merges)
    print(f"BPE tokenizer: {len(tokenizer)} tokens ({args.merges} merges asked)", flush=True)
    teacher = sft(
        initial_model(args.teacher_init, task.teacher_config, tokenizer, seed=args.seed),
        tokenizer,
        steps=args.teacher_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        target=args.target,
        root=out.parent / ".train_teacher_bpe",
        task=task,
        rows=teacher_rows(task, args.train_rows),
    )
    test_rows = task.rows("test")
    score = dict(metrics={"accuracy": task.metric}, max_new_tokens=task.max_new_tokens, max_length=task.max_length)
    accuracy = evaluate_generations(teacher.model, tokenizer, test_rows, **score)["accuracy"]
    print(f"teacher: {teacher.global_step} steps, test accuracy {accuracy:.4f}")
    if accuracy < args.required:
        print(
            f"teacher test accuracy {accuracy:.4f} < required {args.required}; raise --teacher-steps", file=sys.stderr
        )
        return 1
    seconds = round(time.perf_counter() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    teacher.export(out / "teacher")
    # what users load: the saved folder, through load_tokenizer (AutoTokenizer would build Qwen2's tokenizer here)
    shipped = load_tokenizer(out / "teacher")
    student_tokenizer = load_tokenizer(ASSETS / task.assets / "student_init")
    manifest = {
        "task": f"lightning_gkd.toy.tasks.TOY_TASKS[{task.name!r}] ({task.description})",
        "tokenizer": {
            "builder": "lightning_gkd.data.tokenizer.build_chatml_bpe_tokenizer (byte-level BPE, ChatML specials)",
            "corpus": f"the ChatML chat text of the task's {len(task.rows('train'))} training rows",
            "merges": args.merges,
            "vocabulary_size": len(shipped),
            "load_with": "lightning_gkd.data.tokenizer.load_tokenizer",
        },
        "teacher": {
            "config": {**task.teacher_config, "vocab_size": len(tokenizer)},
            "initialised_from": str(args.teacher_init) if args.teacher_init else "random",
            "train_rows": len(task.rows("train", args.train_rows)),
            "sft_steps": teacher.global_step,
            "test_accuracy": accuracy,
        },
        "student": f"assets/{task.assets}/student_init (the byte tokenizer), unchanged",
        "pairing": tokenizer_pairing(student_tokenizer, shipped, test_rows),
        "training": {
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "schedule": "cosine with warmup",
            "seconds": seconds,
        },
        "command": "python scripts/train_toy_teacher.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
