"""A teacher-cache build with 2 CPU processes (gloo DDP) for tests/teachers/offline/test_build.py.

    python tests/helpers/cache_build_worker.py <cache_dir> [--kill-after-first-shard]

Lightning's DDP launcher starts rank 1 by re-running this script. ``--kill-after-first-shard``: each rank SIGKILLs
itself once it has written its first shard (rank 1 first waits for rank 0's, so the folder ends up with exactly
shards 0 and 1 whichever rank is faster). Otherwise rank 0 writes ``<cache_dir>.result.json`` (this run's report).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.teachers.offline.build import build_teacher_cache
from lightning_gkd.teachers.offline.shards import shard_name
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

#: what the single-process reference build of the test uses too
ROWS, TOP_K, MAX_LENGTH, BATCH_SIZE, SHARD_SIZE = 96, 20, 64, 8, 16


def settings() -> dict:
    return {"top_k": TOP_K, "max_length": MAX_LENGTH, "batch_size": BATCH_SIZE, "shard_size": SHARD_SIZE}


class KillAfterFirstFile(L.Callback):
    """SIGKILL this rank once one of its files (``file(s)`` for ``s % world_size == rank`` in a fresh build) is on
    disk; rank 1 first waits for rank 0's ``file(0)``, so exactly files 0 and 1 are left whichever rank is faster."""

    def __init__(self, file: Callable[[int], Path]) -> None:
        self.file = file

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        if not any(self.file(s).is_file() for s in range(rank, 64, world)):
            return
        deadline = time.monotonic() + 120
        while rank and not self.file(0).is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    folder = Path(sys.argv[1])
    kill = "--kill-after-first-shard" in sys.argv[2:]
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
        callbacks=[KillAfterFirstFile(lambda s: folder / shard_name(s))] if kill else [],
    )
    report = build_teacher_cache(
        teacher, load_tokenizer(teacher), addition_rows("train")[:ROWS], folder, trainer=trainer, **settings()
    )
    if trainer.is_global_zero:
        result = {
            "world_size": trainer.world_size,
            "backend": torch.distributed.get_backend(),
            "built_shards": report.built_shards,
            "built_tokens": report.built_tokens,
        }
        folder.with_name(folder.name + ".result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
