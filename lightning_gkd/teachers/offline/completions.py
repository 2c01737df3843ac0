"""Offline sequence-level KD: the teacher writes the completions once, before the cache is built over them.

``lightning-gkd-cache cache.completions=teacher`` replaces every training row's answer by the teacher's own
completion of its prompt (our KV-cache sampler; greedy at ``temperature`` 0) and writes them to
``<cache>/completions.jsonl`` (chat rows); the cache is then built over those rows, and training reads the same file
(``data.train_data=<cache>/completions.jsonl``) with ``teacher=cache``: SeqKD with no teacher model in the training
process.

``build_teacher_completions`` runs the teacher in a Lightning predict loop on the cache build's trainer, with the
cache's resumable sharded writer (``teachers.offline.sharded_writer``): the rows are cut into parts of
``shard_size`` consecutive rows, the parts still to write are dealt to the ranks round-robin, and a part is written
to ``completions_parts/`` once all its rows are answered (to ``.tmp``, then an atomic rename). A batch never crosses
a part and is seeded by its first row's index, so a part's text does not depend on the rank, the world size or an
interrupted earlier run. Rank 0 then joins the parts into ``completions.jsonl``. ``completions.json`` records the
settings before the first part: a rerun with the same ones writes only the missing parts (or reuses the finished
file), other settings are refused before the teacher loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.models.loading import ModelSource, load_frozen_causal_lm
from lightning_gkd.ops.decoding.sampling import complete_prompts, derive_seed
from lightning_gkd.teachers.offline.atomic import write_atomically
from lightning_gkd.teachers.offline.sharded_writer import ShardedWriter, count_shards

COMPLETIONS_FILE = "completions.jsonl"
SETTINGS_FILE = "completions.json"
PARTS_DIR = "completions_parts"


def teacher_completion_rows(
    teacher: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
) -> list[dict[str, Any]]:
    """``rows`` (chat rows) with the final assistant message (if any) replaced by ``teacher``'s completion of the
    prompt: at most ``max_new_tokens`` tokens, greedy at ``temperature`` 0, else sampled (each batch seeded by
    ``seed`` and its first row's index). Other columns are kept. In this process; ``build_teacher_completions`` is the
    sharded, resumable build."""
    collate = ChatMLCollator(tokenizer, max_length=max_length, name="train_data")
    out: list[dict[str, Any]] = []
    for start in range(0, len(rows), batch_size):
        part = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
        out += complete_batch(
            teacher,
            tokenizer,
            part,
            collate(part),
            start,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
        )
    return out


def complete_batch(
    teacher: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    batch: Mapping[str, torch.Tensor],
    first_row: int,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> list[dict[str, Any]]:
    """``rows`` with the teacher's completion of each prompt (``batch``: their ``ChatMLCollator`` batch; the draw is
    seeded by ``seed`` and ``first_row``, the index of ``rows[0]`` in the dataset)."""
    device = next(teacher.parameters()).device
    sampled = complete_prompts(
        teacher,
        tokenizer,
        batch["prompts"].to(device),
        batch["prompt_attention_mask"].to(device),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=derive_seed(seed, first_row),
    )
    width = batch["prompts"].shape[1]
    out: list[dict[str, Any]] = []
    for row, ids, labels in zip(rows, sampled["input_ids"], sampled["labels"], strict=True):
        completion = ids[width:][labels[width:] != -100]
        text = tokenizer.decode(completion.tolist(), skip_special_tokens=True)
        messages = list(row["messages"])
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        out.append({**row, "messages": [*messages, {"role": "assistant", "content": text}]})
    return out


def part_name(part: int) -> str:
    return f"part-{part:05d}.jsonl"


class CompletionPartWriter(ShardedWriter):
    """The completions' parts (``ShardedWriter``): each batch of rows collated (``ChatMLCollator``) with the rows and
    its first row's index (``TeacherCompletionModule.predict_step`` answers them), one JSON-lines part per
    ``shard_size`` rows."""

    what = "Teacher completion parts"

    def shard_name(self, shard: int) -> str:
        return part_name(shard)

    def make_batch(self, indices: range) -> dict[str, Any]:
        rows = [self.rows[index] for index in indices]
        return {**self.collate(rows), "rows": rows, "first_row": indices.start}

    def predicted_rows(self, prediction: Mapping[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
        for offset, row in enumerate(prediction["rows"]):
            yield prediction["first_row"] + offset, row

    def write_records(self, path: Path, records: list[Any]) -> None:
        with open(path, "w") as handle:
            for row in records:
                handle.write(json.dumps(row, sort_keys=True) + "\n")


class TeacherCompletionModule(L.LightningModule):
    """The frozen teacher; ``predict_step`` answers a batch of prompts (``complete_batch``)."""

    def __init__(
        self,
        teacher: ModelSource,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.teacher = load_frozen_causal_lm(teacher, role="teacher", trust_remote_code=trust_remote_code)
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        rows = complete_batch(
            self.teacher,
            self.tokenizer,
            batch["rows"],
            batch,
            batch["first_row"],
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
        )
        return {"first_row": batch["first_row"], "rows": rows}


def build_teacher_completions(
    teacher: ModelSource,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    folder: str | Path,
    settings: Mapping[str, Any],
    *,
    trainer: L.Trainer,
    max_length: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
    shard_size: int = 1024,
    trust_remote_code: bool = False,
) -> Path:
    """``<folder>/completions.jsonl``: ``rows`` with the teacher's completions (``teacher_completion_rows``' rows),
    made on ``trainer``'s devices and processes in parts of ``shard_size`` rows (the module docstring), or reused /
    resumed when ``completions.json`` holds the same ``settings`` (with these arguments); other settings raise
    ``ValueError`` naming the differences, before the teacher loads."""
    folder = Path(folder)
    settings = {
        **settings,
        "max_length": max_length,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "batch_size": batch_size,
        "shard_size": shard_size,
        "num_rows": len(rows),
        "precision": str(trainer.precision),
    }
    path, recorded, parts = folder / COMPLETIONS_FILE, folder / SETTINGS_FILE, folder / PARTS_DIR
    if recorded.is_file():
        before = json.loads(recorded.read_text())
        if before != settings:
            changed = {
                k: (before.get(k), settings.get(k)) for k in {*before, *settings} if before.get(k) != settings.get(k)
            }
            raise ValueError(
                f"{folder} holds teacher completions made with other settings ({changed}: there, now). Use another "
                "cache.path, or delete the folder to remake them."
            )
        if path.is_file():
            return path
    parts.mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    write_atomically(recorded, lambda tmp: tmp.write_text(text), tmp_suffix=f".{os.getpid()}.tmp")  # every rank
    module = TeacherCompletionModule(
        teacher,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        trust_remote_code=trust_remote_code,
    )
    collate = ChatMLCollator(tokenizer, max_length=max_length, name="train_data")
    CompletionPartWriter(parts, rows, collate, shard_size=shard_size, batch_size=batch_size).predict(trainer, module)
    if trainer.is_global_zero:

        def join_parts(tmp: Path) -> None:
            with open(tmp, "w") as handle:
                for part in range(count_shards(len(rows), shard_size)):
                    handle.write((parts / part_name(part)).read_text())

        write_atomically(path, join_parts)
    trainer.strategy.barrier("teacher_completions")
    return path
