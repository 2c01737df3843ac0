"""Offline SeqKD completions (``build_teacher_completions``) with 2 CPU processes (gloo DDP) for
tests/teachers/offline/test_completions.py.

    python tests/helpers/completions_build_worker.py <folder> [--kill-after-first-part]

Lightning's DDP launcher starts rank 1 by re-running this script. ``--kill-after-first-part``: each rank SIGKILLs
itself once it has written its first part (rank 1 first waits for rank 0's, so the folder ends up with exactly parts
0 and 1 whichever rank is faster). Otherwise rank 0 writes ``<folder>.result.json`` (the world size, the parts this
run wrote).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.*

from helpers.cache_build_worker import KillAfterFirstFile  # noqa: E402
from lightning_gkd.data.tokenizer import load_tokenizer  # noqa: E402
from lightning_gkd.teachers.offline.completions import PARTS_DIR, build_teacher_completions, part_name  # noqa: E402
from lightning_gkd.toy import addition_rows  # noqa: E402
from lightning_gkd.toy.tiny import asset_path  # noqa: E402

#: what the single-process reference of the test uses too
ROWS, MAX_LENGTH, MAX_NEW_TOKENS, TEMPERATURE, BATCH_SIZE, SHARD_SIZE = 40, 64, 6, 0.8, 4, 8


def arguments() -> dict:
    return {
        "max_length": MAX_LENGTH,
        "max_new_tokens": MAX_NEW_TOKENS,
        "temperature": TEMPERATURE,
        "seed": 3,
        "batch_size": BATCH_SIZE,
        "shard_size": SHARD_SIZE,
    }


def main() -> None:
    folder = Path(sys.argv[1])
    kill = "--kill-after-first-part" in sys.argv[2:]
    torch.set_num_threads(1)
    teacher = asset_path("toy/teacher")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[KillAfterFirstFile(lambda p: folder / PARTS_DIR / part_name(p))] if kill else [],
    )
    before = {p.name for p in (folder / PARTS_DIR).glob("part-*.jsonl")}
    rows = addition_rows("train")[:ROWS]
    path = build_teacher_completions(
        str(teacher), load_tokenizer(teacher), rows, folder, {"teacher": "toy"}, trainer=trainer, **arguments()
    )
    if trainer.is_global_zero:
        written = sorted({p.name for p in (folder / PARTS_DIR).glob("part-*.jsonl")} - before)
        result = {"world_size": trainer.world_size, "written": written, "path": str(path)}
        folder.with_name(folder.name + ".result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
