"""Train a toy task's teacher with SFTModule, make the student's starting point, and save both as package
assets (save_pretrained + tokenizer) under lightning_gkd/assets/<task assets>/.

    python scripts/train_toy_teacher.py                 # writes lightning_gkd/assets/toy/{teacher,student_init}
    python scripts/train_toy_teacher.py --task chain    # writes lightning_gkd/assets/toy_chain/...

The teacher is trained until its validation exact-match reaches --target (early stop) and must reach it on the
test split, else the script exits non-zero. The student is a smaller model given a brief SFT that stops
once its validation accuracy passes --student-target, so it starts well below the teacher. Both are deterministic
for a given --seed on one machine.
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

from lightning_gkd import ChatDataModule, SFTModule
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.data.toy.tasks import TOY_TASKS, ToyTask, toy_task
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.models.tiny import tiny_causal_lm

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
) -> SFTModule:
    """SFT ``model`` on the toy ``task`` (default addition), or on ``rows`` = (train, val) when given."""
    L.seed_everything(seed, workers=True)
    module = SFTModule(
        model,
        tokenizer,
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=min(100, steps // 10), num_training_steps=steps
        ),
        metrics={"accuracy": task.metric},
        eval_max_new_tokens=task.max_new_tokens,
        seed=seed,
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
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        val_check_interval=min(val_every, steps),
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        default_root_dir=root,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, datamodule=data)
    return module


def initial_model(folder: Path | None, config: dict, tokenizer, *, seed: int) -> torch.nn.Module:
    """Random weights of shape ``config``, or the model in ``folder`` (which must have that shape) with room for
    ``config``'s positions (RoPE: no position table to grow)."""
    if folder is None:
        return tiny_causal_lm(config, tokenizer, seed=seed)
    model = load_causal_lm(str(folder))
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size"):
        if getattr(model.config, key) != config[key]:
            raise ValueError(f"{folder}: {key}={getattr(model.config, key)}, the task's models have {config[key]}.")
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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = toy_task(args.task)
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
        "task": f"lightning_gkd.data.toy.tasks.TOY_TASKS[{task.name!r}] ({task.description})",
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


if __name__ == "__main__":
    sys.exit(main())
