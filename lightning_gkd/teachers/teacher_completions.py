"""Offline sequence-level KD: the teacher writes the completions once, before the cache is built over them.

``lightning-gkd-cache cache.completions=teacher`` replaces every training row's answer by the teacher's own
completion of its prompt (our KV-cache sampler; greedy at ``temperature`` 0) and writes them to
``<cache>/completions.jsonl`` (chat rows); the cache is then built over those rows, and training reads the same file
(``data.train_data=<cache>/completions.jsonl``) with ``teacher=cache``: SeqKD with no teacher model in the training
process.

``build_teacher_completions`` runs the teacher in a Lightning predict loop on the cache build's trainer, sharded and
resumable like the cache (``cache_build``): the rows are cut into parts of ``shard_size`` consecutive rows, the
parts still to write are dealt to the ranks round-robin, and a part is written to ``completions_parts/`` once all its
rows are answered (to ``.tmp``, then an atomic rename). A batch never crosses a part and is seeded by its first row's
index, so a part's text does not depend on the rank, the world size or an interrupted earlier run. Rank 0 then joins
the parts into ``completions.jsonl``. ``completions.json`` records the settings before the first part: a rerun with
the same ones writes only the missing parts (or reuses the finished file), other settings are refused before the
teacher loads.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.models.loading import ModelSource, load_frozen_causal_lm
from lightning_gkd.ops.decoding.sampling import derive_seed, generate_completions
from lightning_gkd.ops.hf.forward import resolve_eos_token_id, resolve_pad_token_id
from lightning_gkd.teachers.cache import shard_rows

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
    sampled = generate_completions(
        teacher,
        batch["prompts"].to(device),
        batch["prompt_attention_mask"].to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=resolve_pad_token_id(tokenizer),
        eos_token_id=resolve_eos_token_id(teacher, tokenizer),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
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


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    os.replace(tmp, path)


class _PromptBatches(IterableDataset):
    """The collated batches of ``batches`` (row-index ranges), each with its rows and its first row's index."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], collate: ChatMLCollator, batches: list[range]) -> None:
        self.rows, self.collate, self.batches = rows, collate, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for indices in self.batches:
            part = [self.rows[i] for i in indices]
            yield {**self.collate(part), "rows": part, "first_row": indices.start}


class CompletionParts(L.LightningDataModule):
    """Each rank's loader over its share of the parts still to write (rank 0 lists them, then broadcasts)."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        folder: Path,
        *,
        max_length: int,
        shard_size: int,
        batch_size: int,
    ) -> None:
        super().__init__()
        self.rows, self.folder = rows, folder
        self.collate = ChatMLCollator(tokenizer, max_length=max_length, name="train_data")
        self.shard_size, self.batch_size = shard_size, batch_size
        self.pending: list[int] = []  # the parts this run writes, over all ranks
        self.parts: list[int] = []  # this rank's

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        assert trainer is not None  # Lightning calls setup from a trainer
        count = -(-len(self.rows) // self.shard_size)
        pending = [p for p in range(count) if not (self.folder / part_name(p)).is_file()]
        self.pending = list(trainer.strategy.broadcast(pending if trainer.is_global_zero else [], src=0))
        self.parts = self.pending[trainer.global_rank :: trainer.world_size]

    def predict_dataloader(self) -> DataLoader:
        batches = [
            indices[start : start + self.batch_size]
            for part in self.parts
            for indices in [shard_rows(part, len(self.rows), self.shard_size)]
            for start in range(0, len(indices), self.batch_size)
        ]
        return DataLoader(_PromptBatches(self.rows, self.collate, batches), batch_size=None, collate_fn=None)


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


class PartWriter(BasePredictionWriter):
    """Collects answered rows per part and writes each part when it is whole."""

    def __init__(self, folder: Path, *, num_rows: int, shard_size: int) -> None:
        super().__init__(write_interval="batch")
        self.folder, self.num_rows, self.shard_size = folder, num_rows, shard_size
        self.buffers: dict[int, dict[int, dict[str, Any]]] = {}

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        for offset, row in enumerate(prediction["rows"]):
            index = prediction["first_row"] + offset
            part = index // self.shard_size
            buffer = self.buffers.setdefault(part, {})
            buffer[index] = row
            if len(buffer) == len(shard_rows(part, self.num_rows, self.shard_size)):
                _write_jsonl(self.folder / part_name(part), [buffer[i] for i in sorted(buffer)])
                del self.buffers[part]

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.buffers:
            raise RuntimeError(f"Teacher completion parts {sorted(self.buffers)} did not receive all their rows.")


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
    tmp = recorded.with_name(f"{recorded.name}.{os.getpid()}.tmp")  # every rank writes the same bytes
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, recorded)
    data = CompletionParts(rows, tokenizer, parts, max_length=max_length, shard_size=shard_size, batch_size=batch_size)
    module = TeacherCompletionModule(
        teacher,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        trust_remote_code=trust_remote_code,
    )
    writer = PartWriter(parts, num_rows=len(rows), shard_size=shard_size)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    callbacks.insert(0, writer)
    try:
        with warnings.catch_warnings():  # expected: an iterable of ready batches
            warnings.filterwarnings("ignore", message=".*IterableDataset` has `__len__` defined")
            warnings.filterwarnings("ignore", message="Couldn't infer the batch indices")
            trainer.predict(module, datamodule=data, return_predictions=False)
    finally:
        callbacks.remove(writer)
    trainer.strategy.barrier("teacher_completion_parts")
    if trainer.is_global_zero:
        count = -(-len(rows) // shard_size)
        tmp_path = path.with_name(path.name + ".tmp")
        with open(tmp_path, "w") as handle:
            for part in range(count):
                handle.write((parts / part_name(part)).read_text())
        os.replace(tmp_path, path)
    trainer.strategy.barrier("teacher_completions")
    return path
