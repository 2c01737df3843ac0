"""Tool-rollout fits the rollout tests share: a scripted student writing each row's reference turns, and a grouped
generation run (batch 2, 3 steps per generation) whose resume is compared with the uninterrupted run."""

from __future__ import annotations

import csv
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tools import TOOLS
from tests.helpers.fitting import small_trainer
from tests.helpers.scripted_sampler import ScriptedSampler


def reference_script(rows: list[dict]) -> dict[str, list[str]]:
    """A ``ScriptedSampler`` script that writes each row's reference transcript (its assistant turns, in order)."""
    return {
        row["messages"][0]["content"]: [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        for row in rows
    }


def grouped_tool_run(
    tokenizer,
    rows: list[dict],
    tmp_path: Path,
    *,
    max_steps: int,
    ckpt_path: str | None = None,
    every: int | None = None,
    assistant_turns: str = "all",
) -> tuple[list[float], list[float]]:
    """GKD (λ=0.5) with the toy tools and a scripted student, batch 2, ``steps_per_generation=3``, checkpoints every
    ``every`` steps (None: none), resumed from ``ckpt_path``: the logged ``train/loss`` and ``train/on_policy`` per
    step. ``assistant_turns``: the dataset rows' (a template that rewrites earlier turns needs "last")."""
    module = GKDModule(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
        tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1),
        tokenizer,
        lmbda=0.5,
        sampling={"sampler": ScriptedSampler(tokenizer, reference_script(rows)), "max_new_tokens": 64},
        rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
        training={"seed": 5, "optimizer": partial(torch.optim.AdamW, lr=1e-2)},
    )
    datamodule = ChatDataModule(
        tokenizer,
        rows,
        batch_size=2,
        max_length=400,
        steps_per_generation=3,
        seed=5,
        assistant_turns=assistant_turns,
        length_check_rows=4,
    )
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = small_trainer(
        tmp_path, csv=True, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(every)
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    with open(tmp_path / "metrics.csv") as handle:
        table = list(csv.DictReader(handle))
    losses = [float(r["train/loss"]) for r in table if r.get("train/loss")]
    return losses, [float(r["train/on_policy"]) for r in table if r.get("train/on_policy")]
