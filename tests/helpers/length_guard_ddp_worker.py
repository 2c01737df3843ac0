"""A two-process DDP fit on CPU (gloo) for tests/callbacks/test_length_guard.py: LengthGuard's figures over both
ranks' validation rows. Rank 0 writes <out>/result.json.

    python tests/helpers/length_guard_ddp_worker.py <out_dir>

Lightning's DDP launcher starts rank 1 by re-running this script. The student and teacher are tiny random models
with EOS boosts (tests/helpers/eos_boost.py) that make some answers stop early; lr = 0, so validation measures the
models as built. Each rank records what it counted itself, before the guard sums the counts over the ranks.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.callbacks import LengthGuard
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm
from tests.helpers.eos_boost import boost_eos
from tests.helpers.fitting import small_trainer

STUDENT_BOOST, TEACHER_BOOST, BUDGET, VAL_ROWS = 0.9, 1.0, 8, 8


class RankCounts(L.Callback):
    """This rank's own counts and prompts, read before LengthGuard (the next callback) reduces them."""

    def __init__(self, guard: LengthGuard) -> None:
        self.guard = guard
        self.counts: dict = {}
        self.prompts: list[list[int]] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        for ids, mask in zip(batch["prompts"].tolist(), batch["prompt_attention_mask"].tolist(), strict=True):
            self.prompts.append([t for t, keep in zip(ids, mask, strict=True) if keep])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        student, teacher = pl_module.completion_lengths, self.guard._measuring_teacher
        self.counts = {
            "student": [student.tokens, student.rows, student.stopped],
            "teacher": [teacher.tokens, teacher.rows, teacher.stopped],
        }


def main() -> None:
    out = Path(sys.argv[1])
    tokenizer = build_chatml_tokenizer()
    module = GKDModule(
        boost_eos(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), tokenizer, STUDENT_BOOST),
        boost_eos(tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), tokenizer, TEACHER_BOOST),
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 4},
        training={"optimizer": partial(torch.optim.SGD, lr=0.0)},
        validation={"max_new_tokens": BUDGET, "metrics": {}},
    )
    data = ChatDataModule(
        tokenizer, addition_rows("train", 16), addition_rows("val", VAL_ROWS), batch_size=2, max_length=64
    )
    guard = LengthGuard(min_length_ratio=0.0, max_eos_drop=1.0)
    counts = RankCounts(guard)
    trainer = small_trainer(
        out,
        devices=2,
        strategy="ddp",
        max_steps=2,
        limit_val_batches=1.0,
        val_check_interval=2,
        num_sanity_val_steps=0,
        callbacks=[counts, guard],
    )
    trainer.fit(module, datamodule=data)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"counts": counts.counts, "prompts": counts.prompts, "figures": guard.figures})
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        result = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "ranks": ranks}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
