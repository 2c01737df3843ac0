"""Two-process fits on CPU (gloo) for tests/methods/test_base.py: gradients are freed after each optimizer step under
DDP and FSDP2, and training is bit-equal to Lightning's own step. Every rank writes <out>/rank<r>.json.

    python tests/helpers/gradient_freeing_worker.py <out_dir> ddp|fsdp

Lightning starts rank 1 by re-running this script. Each fit: ``GKDModule`` (tiny Qwen2 student and teacher, toy
addition rows), lmbda = 1 (every step samples first), 3 steps; once with our ``optimizer_step`` and once with
Lightning's (``StepAsLightningDoes``).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.*

from helpers.gradient_probe import GradientsAtBatchStart, StepAsLightningDoes  # noqa: E402
from helpers.launch import two_process_trainer  # noqa: E402
from lightning_gkd import ChatDataModule, GKDModule  # noqa: E402
from lightning_gkd.data.tokenizer import build_chatml_tokenizer  # noqa: E402
from lightning_gkd.samplers import KVCacheSampler  # noqa: E402
from lightning_gkd.toy import addition_rows  # noqa: E402
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm  # noqa: E402

STEPS = 3


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(out: Path, kind: str, reference: bool) -> dict:
    tokenizer = build_chatml_tokenizer()
    data = ChatDataModule(tokenizer, addition_rows("train", 16), batch_size=2, max_length=64, seed=0)
    L.seed_everything(0)
    cls = type("ReferenceGKDModule", (StepAsLightningDoes, GKDModule), {}) if reference else GKDModule
    module = cls(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
        tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1),
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 4, "sampler": partial(KVCacheSampler, matmul_precision="highest")},
        training={"frozen_dtype": "float32", "optimizer": partial(torch.optim.AdamW, lr=1e-2), "seed": 0},
    )
    probe, losses = GradientsAtBatchStart(), Losses()
    trainer = two_process_trainer(out, kind, STEPS, callbacks=[probe, losses])
    trainer.fit(module, datamodule=data)
    state = module._full_state_dict if kind == "fsdp" else module.model.state_dict()
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "grads_at_batch_start": probe.seen,
        "losses": losses.losses,
        "state": {k: v.detach().clone().cpu() for k, v in (state or {}).items()},
    }


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    ours, lightning = fit(out, kind, reference=False), fit(out, kind, reference=True)
    result = {key: ours[key] for key in ("rank", "world_size", "strategy", "grads_at_batch_start", "losses")}
    result |= {
        "reference_grads_at_batch_start": lightning["grads_at_batch_start"],
        "reference_losses": lightning["losses"],
        "weights_compared": len(ours["state"]),
        "unequal": [k for k in ours["state"] if not torch.equal(ours["state"][k], lightning["state"].get(k))],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
