"""Build a teacher cache (the format: ``teachers.offline.format``) with a Lightning predict loop.

The training rows are cut into shards of ``shard_size`` consecutive rows and written by the offline room's one
resumable, sharded predict loop (``teachers.offline.sharded_writer``: the missing shards dealt to the ranks, batches
that never cross a shard, each shard written whole with an atomic rename once all its rows are predicted), so a
shard's bytes do not depend on the rank, the world size or an earlier interrupted run. Rank 0 writes a "building"
manifest with every setting before the first shard and the complete one at the end; a rerun with the same settings
writes only the missing shards, a rerun with others is refused before any model loads.

``signal=hidden`` caches the teacher's final hidden states instead of its top-k: the teacher's head is proven to
describe its logits (``ops.hf.check_output_head``, on one short row before anything is written; a head it cannot
describe is refused) and written once to ``head.safetensors`` by rank 0 when the predict loop starts.

    lightning-gkd-cache cache.path=outputs/teacher_cache cache.top_k=20     # lightning_gkd/cli/cache_teacher.py
    lightning-gkd-cache cache.path=outputs/hidden_cache cache.signal=hidden
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pyarrow.compute as pc
import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import ChatMLCollator, prepare_tokenizer
from lightning_gkd.data.rows import ROW_INDEX, RowDataset
from lightning_gkd.data.tokenizer import tokenizer_fingerprint
from lightning_gkd.models.loading import (
    ModelSource,
    limit_output_rows,
    load_frozen_causal_lm,
    source_vocab_size,
    vocab_size,
)
from lightning_gkd.ops.hf.forward import unwrap
from lightning_gkd.ops.hf.heads import LeanForwardUnsupported, check_output_head, output_head
from lightning_gkd.teachers.base import supervised_positions
from lightning_gkd.teachers.local import LocalTeacher
from lightning_gkd.teachers.offline.completions import COMPLETIONS_FILE, PARTS_DIR, SETTINGS_FILE
from lightning_gkd.teachers.offline.fingerprints import data_fingerprint, row_keys, teacher_identity
from lightning_gkd.teachers.offline.format import (
    FORMAT_VERSION,
    HEAD_NAME,
    MANIFEST_NAME,
    HiddenRecord,
    Record,
    check_signal,
    encode_hidden,
    manifest_signal,
)
from lightning_gkd.teachers.offline.head import read_head_description, write_head
from lightning_gkd.teachers.offline.manifest import missing_shards, new_manifest, read_manifest, write_manifest
from lightning_gkd.teachers.offline.sharded_writer import ShardedWriter, count_shards, shard_rows
from lightning_gkd.teachers.offline.shards import read_shards, shard_name, write_shard_file

COMPLETION_FILES = (COMPLETIONS_FILE, SETTINGS_FILE, COMPLETIONS_FILE + ".tmp", PARTS_DIR)
#: tokens of the first row that prove a teacher's head before a hidden-state build (``TeacherCacheModule``)
PROBE_TOKENS = 8


def check_cache_folder(path: str | Path, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """Before any model loads: ``path`` is (or can be made) a writable folder, and a cache already there was
    started with ``settings``. Returns its manifest (None for a new cache)."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"cache.path {folder} is a file; give a folder for the teacher cache.")
    existing = read_manifest(folder) if folder.is_dir() else None
    # the teacher's own completions (offline SeqKD, cache.completions=teacher) are written there first
    others = [p for p in folder.iterdir() if p.name not in COMPLETION_FILES] if folder.is_dir() else []
    if existing is None and others:
        raise FileExistsError(
            f"cache.path {folder} is not empty and has no {MANIFEST_NAME}: it is not a teacher cache. Choose an "
            "empty or new folder."
        )
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"cache.path {folder} is not writable.")
    if existing is None:
        return None
    wanted = {"format_version": FORMAT_VERSION, **settings}
    there = {**existing, "signal": manifest_signal(existing)}  # caches from before signal= hold top-k
    differences = [
        f"{key}: {there.get(key)!r} there, {value!r} now" for key, value in wanted.items() if there.get(key) != value
    ]
    if differences:
        raise ValueError(
            f"The teacher cache at {folder} was started with other settings ({'; '.join(differences)}). "
            "Resume it with the settings it was started with, or build into another cache.path (or delete "
            f"{folder})."
        )
    return existing


class IndexedChatCollator:
    """``ChatMLCollator``'s ``input_ids``, ``attention_mask``, ``labels`` (B, L), plus ``row_index`` (B,) int64:
    each row's ``ROW_INDEX``, as ``RowDataset`` gives it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int) -> None:
        self.collator = ChatMLCollator(tokenizer, max_length=max_length, name="train_data")

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collator(rows)
        out = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
        out["row_index"] = torch.tensor([int(row[ROW_INDEX]) for row in rows], dtype=torch.long)
        return out


class TeacherCacheModule(L.LightningModule):
    """The frozen teacher; ``predict_step`` gives a batch's records: ``keys`` (B,) str, ``row_index`` and
    ``counts`` (B,) int64 (supervised positions per row), then for ``signal=topk`` ``ids`` (N, k) int32,
    ``logprobs`` (N, k) and ``next_logprobs`` (N,) float16, for ``signal=hidden`` ``hidden`` (N, H) float16 or
    uint16 (bfloat16 bits, ``hidden_dtype``), the N positions row-major.

    ``signal=hidden`` needs ``probe`` (a batch's ``input_ids`` and ``attention_mask``; a few tokens suffice): the
    teacher's head is proven on it here (``check_output_head``), so a teacher whose logits are not
    ``softcap(scale · (h Wᵀ + b))`` of its final hidden states is refused before anything is written."""

    def __init__(
        self,
        teacher: ModelSource,
        *,
        top_k: int = 20,
        signal: str = "topk",
        hidden_dtype: str = "float16",
        probe: Mapping[str, torch.Tensor] | None = None,
        trust_remote_code: bool = False,
        chunk_size: int = 256,
        vocab_rows: int | None = None,
    ) -> None:
        super().__init__()
        check_signal(signal, hidden_dtype)
        self.signal, self.hidden_dtype = signal, hidden_dtype
        self.teacher = load_frozen_causal_lm(teacher, role="teacher", trust_remote_code=trust_remote_code)
        if vocab_rows is not None:  # a student padded to fewer rows: the signal over the ids both have
            limit_output_rows(self.teacher, vocab_rows)
        if signal == "topk":
            size = vocab_size(self.teacher)
            if size is not None and top_k > size:
                raise ValueError(f"cache.top_k={top_k} exceeds the teacher's vocabulary of {size} tokens.")
        else:
            if probe is None:
                raise ValueError("TeacherCacheModule(signal='hidden') needs a probe batch to prove the teacher's head.")
            prove_head(self.teacher, probe)
        self.source = LocalTeacher(self.teacher, top_k=top_k, chunk_size=chunk_size)

    @property
    def width(self) -> int:
        """The inner length of a record: ``k`` (top-k), or the teacher's hidden size ``H``."""
        if self.signal == "hidden":
            return int(output_head(self.teacher).weight.shape[1])
        assert self.source.top_k is not None  # set from top_k
        return self.source.top_k

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        positions = supervised_positions(batch["labels"])
        records = {
            "keys": row_keys(batch["input_ids"], batch["attention_mask"]),
            "row_index": batch["row_index"].cpu().numpy(),
            "counts": positions.sum(dim=1).cpu().numpy(),
        }
        if self.signal == "hidden":
            hidden, _ = self.source.hidden_states(batch, positions)
            rows = batch["row_index"].tolist()
            where = f" (in the batch of rows {rows[0]}..{rows[-1]})" if rows else ""
            return {**records, "hidden": encode_hidden(hidden, self.hidden_dtype, where=where)}
        signal = self.source.topk(batch, positions)
        assert signal.next_logprobs is not None  # LocalTeacher always gives them
        return {
            **records,
            "ids": signal.ids.to(torch.int32).cpu().numpy(),
            "logprobs": signal.logprobs.to(torch.float16).cpu().numpy(),
            "next_logprobs": signal.next_logprobs.to(torch.float16).cpu().numpy(),
        }


def prove_head(teacher: torch.nn.Module, probe: Mapping[str, torch.Tensor]) -> None:
    """Refuse (``ValueError``, naming the class) a teacher whose logits its ``LogitHead`` description does not
    reproduce on ``probe``: a hidden-state cache would then not give its distributions."""
    try:
        check_output_head(teacher, probe["input_ids"], probe["attention_mask"])
    except LeanForwardUnsupported as reason:
        raise ValueError(
            "cache.signal=hidden stores the teacher's final hidden states and its head, so its logits must be that "
            f"head applied to those states, and {type(unwrap(teacher)).__name__}'s head cannot be described so "
            f"({reason}). Cache its top-k log-probs instead: cache.signal=topk."
        ) from None


class CacheShardWriter(ShardedWriter):
    """The cache's shards (``ShardedWriter``): the batches of ``rows`` as ``collator`` makes them, the records of
    ``TeacherCacheModule.predict_step``, one Arrow shard file per ``shard_size`` rows (``width``: ``k``, or the hidden
    size for ``signal=hidden``, whose head rank 0 writes when the loop starts). Rank 0 writes the "building" manifest
    of ``settings`` before the first shard."""

    what = "Teacher cache shards"

    def __init__(
        self,
        folder: Path,
        rows: Sequence[Mapping[str, Any]],
        collator: IndexedChatCollator,
        settings: Mapping[str, Any],
        *,
        batch_size: int,
        width: int,
    ) -> None:
        super().__init__(folder, RowDataset(rows), collator, shard_size=settings["shard_size"], batch_size=batch_size)
        self.settings, self.width = dict(settings), width
        self.signal, self.hidden_dtype = settings["signal"], settings["hidden_dtype"] or "float16"

    def shard_name(self, shard: int) -> str:
        return shard_name(shard)

    def before_writing(self, pending: list[int]) -> None:
        write_manifest(self.folder, new_manifest(self.settings, "building"))

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.signal == "hidden" and trainer.is_global_zero:  # the same bytes on a resume: a function of the teacher
            assert isinstance(pl_module, TeacherCacheModule)
            write_head(self.folder, output_head(pl_module.teacher))

    def predicted_rows(self, prediction: Mapping[str, Any]) -> Iterator[tuple[int, Record | HiddenRecord]]:
        ends = np.cumsum(prediction["counts"])
        for row, (key, index) in enumerate(zip(prediction["keys"], prediction["row_index"], strict=True)):
            lo, hi = (int(ends[row - 1]) if row else 0), int(ends[row])
            if self.signal == "hidden":
                yield int(index), HiddenRecord(int(index), key, prediction["hidden"][lo:hi])
            else:
                yield (
                    int(index),
                    Record(
                        int(index),
                        key,
                        prediction["ids"][lo:hi],
                        prediction["logprobs"][lo:hi],
                        prediction["next_logprobs"][lo:hi],
                    ),
                )

    def write_records(self, path: Path, records: list[Any]) -> None:
        write_shard_file(path, records, self.width, signal=self.signal, hidden_dtype=self.hidden_dtype)


def finalize_cache(folder: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Check every shard and write the complete manifest (per-shard rows, tokens, bytes; totals)."""
    hidden = settings["signal"] == "hidden"
    if hidden and not (folder / HEAD_NAME).is_file():
        raise RuntimeError(f"The hidden-state cache at {folder} has no {HEAD_NAME}: rerun the build to write it.")
    head = read_head_description(folder) if hidden else None  # written when the loop started
    shards, max_token_id = [], -1
    for shard in range(settings["num_shards"]):
        path = folder / shard_name(shard)
        table = read_shards([path]).data.table
        expected = len(shard_rows(shard, settings["num_rows"], settings["shard_size"]))
        if table.num_rows != expected:
            raise RuntimeError(f"{path} holds {table.num_rows} rows, expected {expected}: delete it and resume.")
        for chunk in [] if hidden else table.column("topk_ids").chunks:
            largest = pc.max(chunk.flatten().flatten()).as_py()
            max_token_id = max(max_token_id, -1 if largest is None else int(largest))
        counted = table.column("hidden" if hidden else "next_logprobs")
        tokens = pc.sum(pc.list_value_length(counted)).as_py() or 0
        shards.append({"name": path.name, "rows": table.num_rows, "tokens": int(tokens), "bytes": path.stat().st_size})
    total_tokens = sum(shard["tokens"] for shard in shards)
    total_bytes = sum(shard["bytes"] for shard in shards)
    manifest = new_manifest(
        settings,
        "complete",
        shards=shards,
        total_tokens=total_tokens,
        total_bytes=total_bytes,
        max_token_id=None if hidden else max_token_id,  # a hidden cache's check: the head's vocab_size
        head=head,
        bytes_per_million_tokens=round(total_bytes * 1e6 / total_tokens, 1) if total_tokens else None,
    )
    write_manifest(folder, manifest)
    for stale in folder.glob("*.tmp"):  # a shard being written when an earlier run was killed
        stale.unlink()
    return manifest


@dataclass(frozen=True)
class CacheBuildReport:
    """A build's outcome: the manifest, and what this run wrote (``built_shards``, ``built_tokens``) in how long
    (``seconds``: from the loaders' setup, the teacher loaded, to the complete manifest)."""

    path: Path
    manifest: dict[str, Any]
    built_shards: int
    built_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.built_tokens / self.seconds if self.seconds > 0 else 0.0


def _trainer(trainer: L.Trainer | Mapping[str, Any] | None) -> L.Trainer:
    if isinstance(trainer, L.Trainer):
        return trainer
    defaults = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
    return L.Trainer(**{**defaults, **dict(trainer or {}), "use_distributed_sampler": False})


def build_teacher_cache(
    teacher: ModelSource,
    tokenizer: PreTrainedTokenizerBase | str,
    rows: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    top_k: int = 20,
    signal: str = "topk",
    hidden_dtype: str = "float16",
    max_length: int = 1024,
    batch_size: int = 32,
    shard_size: int = 1024,
    trainer: L.Trainer | Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    vocab_rows: int | None = None,
) -> CacheBuildReport:
    """Cache ``teacher``'s signal over ``rows`` (chat rows, collated as ``ChatMLCollator`` does at ``max_length``)
    into the folder ``path``, or resume a stopped build with the same settings (others are refused before the teacher
    loads); returns the manifest and this run's figures (``CacheBuildReport``: ``.manifest``).

    ``signal``: ``topk`` (its top-``top_k`` log-probs) or ``hidden`` (its final hidden states, stored as
    ``hidden_dtype`` (``float16``, or ``bfloat16`` for states beyond float16's range), and its head in
    ``head.safetensors``; ``top_k`` is not read). ``teacher``: a model source
    (``lightning_gkd.models.loading.load_causal_lm``). ``tokenizer``: the training run's (or its folder).
    ``batch_size``: rows per teacher forward (per rank); ``shard_size``: rows per shard file. ``trainer``: a
    ``lightning.Trainer`` (its devices, strategy and precision run the teacher) or its keyword arguments (default:
    one process, 32-true). ``vocab_rows``: the signal covers token ids ``[0, vocab_rows)`` only (the teacher's
    distributions renormalised over them: a student whose vocabulary is padded to fewer rows than the teacher's over
    the same tokenizer, as Qwen2.5-0.5B's 151,936 against 7B's 152,064); None: all the teacher's rows. The manifest
    records the range (``vocab_rows``), and training checks it against the student's.
    """
    check_signal(signal, hidden_dtype)
    for name, value in (("top_k", top_k), ("batch_size", batch_size), ("shard_size", shard_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}.")
    teacher_rows = source_vocab_size(teacher, role="teacher")
    if vocab_rows is not None and (vocab_rows < 1 or teacher_rows is not None and vocab_rows > teacher_rows):
        raise ValueError(
            f"vocab_rows={vocab_rows}: the range must be within the teacher's {teacher_rows} vocabulary rows "
            "(null: all of them)."
        )
    if not len(rows):
        raise ValueError("No training rows to cache.")
    tokenizer = prepare_tokenizer(tokenizer)
    folder = Path(path).expanduser()
    trainer = _trainer(trainer)
    hidden = signal == "hidden"
    settings = {  # what the cache is a function of: a resume must give the same
        "signal": signal,
        "k": None if hidden else top_k,
        "vocab_rows": vocab_rows or teacher_rows,  # the ids the signal covers: [0, vocab_rows)
        "hidden_dtype": hidden_dtype if hidden else None,
        "teacher": teacher_identity(teacher),
        "precision": str(trainer.precision),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "data_fingerprint": data_fingerprint(rows),
        "max_length": max_length,
        "num_rows": len(rows),
        "shard_size": shard_size,
        "num_shards": count_shards(len(rows), shard_size),
    }
    existing = check_cache_folder(folder, settings)
    if existing is not None and existing["status"] == "complete" and not missing_shards(folder, existing):
        return CacheBuildReport(folder, existing, 0, 0, 0.0)
    collator = IndexedChatCollator(tokenizer, max_length)
    probe = None
    if hidden:  # the first row's first tokens: enough to prove the head, cheap for any teacher on the CPU
        first = collator([RowDataset(rows)[0]])
        probe = {key: first[key][:, :PROBE_TOKENS] for key in ("input_ids", "attention_mask")}
    module = TeacherCacheModule(
        teacher,
        top_k=top_k,
        signal=signal,
        hidden_dtype=hidden_dtype,
        probe=probe,
        trust_remote_code=trust_remote_code,
        vocab_rows=vocab_rows,
    )
    writer = CacheShardWriter(folder, rows, collator, settings, batch_size=batch_size, width=module.width)
    pending = set(writer.predict(trainer, module))
    if trainer.is_global_zero:
        finalize_cache(folder, settings)
    trainer.strategy.barrier("teacher_cache_manifest")
    manifest = read_manifest(folder)
    assert manifest is not None  # rank 0 just wrote it
    built = sum(shard["tokens"] for index, shard in enumerate(manifest["shards"]) if index in pending)
    return CacheBuildReport(folder, manifest, len(pending), built, time.perf_counter() - writer.started)
