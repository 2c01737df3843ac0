"""Two-process fits on CPU (gloo) for tests/models/test_tied_embedding.py: the tied student's embedding gradient as
the rows looked up (``RowsGradientEmbedding``, the default) against torch's dense path; rank 0 writes
<out>/result.json.

    python tests/helpers/tied_embedding_worker.py <out_dir> ddp|fsdp

Lightning starts rank 1 by re-running this script. Each fit: ``GKDModule`` (tiny tied Qwen2 student and teacher, toy
addition rows), lmbda = 0 (dataset completions, the chunked hidden-state loss), the default fused AdamW, 3 steps,
under DDP or FSDP2 (``ModelParallelStrategy``); the trained student's full weights are compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.*

from helpers.launch import two_process_trainer  # noqa: E402
from lightning_gkd import ChatDataModule, GKDModule  # noqa: E402
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

STEPS = 3


def fit(out: Path, kind: str, rows_gradient: bool) -> tuple[dict[str, torch.Tensor], dict]:
    tokenizer = build_chatml_tokenizer()
    data = ChatDataModule(tokenizer, addition_rows("train", 16), batch_size=2, max_length=64, seed=0)
    L.seed_everything(0)
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    module = GKDModule(
        student, tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1), tokenizer, lmbda=0.0, divergence={"beta": 0.5}
    )
    embedding = module.model.get_input_embeddings()
    made = type(embedding).__name__
    if not rows_gradient:
        embedding.__class__ = nn.Embedding  # torch's dense path
    trainer = two_process_trainer(out, kind, STEPS)
    trainer.fit(module, datamodule=data)
    state = module._full_state_dict if kind == "fsdp" else module.model.state_dict()
    optimizer = trainer.optimizers[0]
    info = {
        "embedding": made,
        "fused": bool(optimizer.defaults.get("fused")),
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "rank": trainer.global_rank,
    }
    return {k: v.detach().clone().cpu() for k, v in (state or {}).items()}, info


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rows, info = fit(out, kind, rows_gradient=True)
    dense, _ = fit(out, kind, rows_gradient=False)
    if info["rank"] != 0:
        return
    before = tiny_causal_lm(TINY_STUDENT, build_chatml_tokenizer(), seed=0).state_dict()
    name = "model.embed_tokens.weight"
    result = {
        **info,
        "names_equal": rows.keys() == dense.keys() and len(rows) > 0,
        "unequal": [k for k in rows if k in dense and not torch.equal(rows[k], dense[k])],
        "max_abs_diff": max((rows[k] - dense[k]).abs().max().item() for k in rows if k in dense),
        "embedding_change": (rows[name] - before[name]).abs().max().item(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
