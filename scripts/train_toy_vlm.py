"""Train the toy vision task's teacher with SFTModule, make the student's starting point, and save both (model and
processor, save_pretrained) under lightning_gkd/assets/toy_vlm/.

    python scripts/train_toy_vlm.py

Both are tiny LLaVA models (``lightning_gkd.toy.tiny_vlm``: a CLIP vision tower, a projector, a Llama language model
over the byte tokenizer plus ``<image>``) on ``lightning_gkd.toy.shape_rows``. The teacher trains until its validation
exact match reaches --target and must reach --required on the test split, else the script exits non-zero. The student,
smaller, gets a brief SFT that stops once its validation accuracy passes --student-target, so it starts well below
the teacher. Deterministic for a given --seed on one machine.
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
from lightning_gkd.evaluation import evaluate_generations, exact_match
from lightning_gkd.studies.step_timing import plain_trainer
from lightning_gkd.toy import shape_rows
from lightning_gkd.toy.tiny_vlm import TOY_VLM_STUDENT, TOY_VLM_TEACHER, tiny_vlm

ASSETS = Path(__file__).resolve().parents[1] / "lightning_gkd" / "assets" / "toy_vlm"
MAX_LENGTH, MAX_NEW_TOKENS = 80, 20


class PrintValidation(L.Callback):
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"step {trainer.global_step}: {metrics}", flush=True)


def sft(model, processor, *, steps: int, lr: float, batch_size: int, seed: int, target: float, val_every: int):
    """SFT ``model`` (its whole self: vision tower included) on the shape rows until validation accuracy ``target``."""
    L.seed_everything(seed, workers=True)
    module = build_method(
        # the toy towers start random: they learn to see (a real student keeps its pretrained tower frozen)
        [
            "method=sft",
            f"method.validation.max_new_tokens={MAX_NEW_TOKENS}",
            "method.training.freeze_vision=false",
            f"seed={seed}",
        ],
        model=model,
        tokenizer=processor.tokenizer,
        optimizer=partial(torch.optim.AdamW, lr=lr),
        scheduler=partial(
            get_cosine_schedule_with_warmup, num_warmup_steps=min(100, steps // 10), num_training_steps=steps
        ),
    )
    data = ChatDataModule(
        processor.tokenizer,
        shape_rows("train"),
        shape_rows("val"),
        processor=processor,
        batch_size=batch_size,
        val_batch_size=200,
        max_length=MAX_LENGTH,
        seed=seed,
    )
    stop = EarlyStopping(
        "val/accuracy", mode="max", stopping_threshold=target, patience=10**6, check_on_train_epoch_end=False
    )
    trainer = plain_trainer(
        steps,
        callbacks=[PrintValidation(), stop],
        limit_val_batches=1.0,
        val_check_interval=min(val_every, steps),
        check_val_every_n_epoch=None,
    )
    trainer.fit(module, datamodule=data)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--teacher-steps", type=int, default=6000)
    parser.add_argument("--student-steps", type=int, default=1000, help="length of the student's LR schedule")
    parser.add_argument("--student-target", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--target", type=float, default=0.985, help="teacher val accuracy that stops training")
    parser.add_argument("--required", type=float, default=0.93, help="teacher test accuracy the script demands")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    test_rows = shape_rows("test")
    score = {"metrics": {"accuracy": exact_match}, "max_new_tokens": MAX_NEW_TOKENS, "max_length": MAX_LENGTH}

    model, processor = tiny_vlm("llava", seed=args.seed, **TOY_VLM_TEACHER)
    teacher = sft(
        model, processor, steps=args.teacher_steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
        target=args.target, val_every=100,
    )  # fmt: skip
    teacher_acc = evaluate_generations(teacher.model, processor.tokenizer, test_rows, processor=processor, **score)
    print(f"teacher: {teacher.global_step} steps, test accuracy {teacher_acc['accuracy']:.4f}", flush=True)
    if teacher_acc["accuracy"] < args.required:
        print(f"teacher test accuracy below {args.required}; raise --teacher-steps", file=sys.stderr)
        return 1
    model, processor = tiny_vlm("llava", seed=args.seed + 1, **TOY_VLM_STUDENT)
    student = sft(
        model, processor, steps=args.student_steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed + 1,
        target=args.student_target, val_every=25,
    )  # fmt: skip
    student_acc = evaluate_generations(student.model, processor.tokenizer, test_rows, processor=processor, **score)
    print(f"student start: {student.global_step} steps, test accuracy {student_acc['accuracy']:.4f}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    teacher.export(args.out / "teacher")
    student.export(args.out / "student_init")
    manifest = {
        "task": "lightning_gkd.toy.shape_rows (name the coloured shape in a 32 px image; exact match)",
        "family": "llava (lightning_gkd.toy.tiny_vlm)",
        "teacher": {"config": TOY_VLM_TEACHER, "sft_steps": teacher.global_step, "test_accuracy": teacher_acc},
        "student_init": {
            "config": TOY_VLM_STUDENT,
            "sft_steps": student.global_step,
            "schedule_steps": args.student_steps,
            "test_accuracy": student_acc,
        },
        "training": {
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "schedule": "cosine with warmup; vision tower and projector trained too",
            "seconds": round(time.perf_counter() - started, 1),
        },
        "command": "python scripts/train_toy_vlm.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
