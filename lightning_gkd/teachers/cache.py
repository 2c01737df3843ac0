"""An offline teacher: top-k log-probs precomputed over the training rows (``lightning_gkd.teachers.cache_build``)
and read back here as a ``SparseTeacher`` (``CacheTeacher``), so distillation needs no teacher forward.

Format: a folder with ``manifest.json`` and Arrow shards ``shard-00000.arrow``, ``shard-00001.arrow``, ... (Hugging
Face ``datasets`` Arrow stream files, written with ``datasets.arrow_writer.ArrowWriter``; ``Dataset.from_file``
memory-maps them). Shard ``s`` holds training rows ``s * shard_size`` up to ``(s + 1) * shard_size``, in row order,
one record per row (``cache_features``):

- ``key`` string: ``row_key`` of the row's unpadded token ids (finds the row whatever the batch order);
- ``row_index`` int64: the row's index in the training rows;
- ``topk_ids`` list<list<int32>> ``(n, k)`` and ``topk_logprobs`` list<list<float16>> ``(n, k)``: at each of the
  row's ``n`` supervised positions (``supervised_positions``, row order), the teacher's ``k`` most likely next
  tokens and their log-probs, most likely first;
- ``next_logprobs`` list<float16> ``(n,)``: the teacher's log-prob of the token that follows each position.

``manifest.json``: ``format``, ``format_version``, ``status`` ("building" until every shard is written, then
"complete"), the settings (``k``, ``teacher`` {name_or_path, revision, dtype, config_hash}, ``precision``,
``tokenizer_fingerprint``, ``data_fingerprint``, ``max_length``, ``num_rows``, ``shard_size``, ``num_shards``) and,
once complete, ``shards`` [{name, rows, tokens, bytes}], ``total_tokens`` (supervised), ``total_bytes``,
``max_token_id`` and ``bytes_per_million_tokens``. No timestamps: the same rows give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.rows import fit_rows
from lightning_gkd.evaluation.model_card import describe_source
from lightning_gkd.teachers.base import TopKSignal

FORMAT = "lightning_gkd.teacher_cache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
BUILD_COMMAND = "lightning-gkd-cache"
#: rows per Arrow record batch in a shard (keeps list offsets far below int32's range)
CHUNK_ROWS = 256


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.arrow"


def cache_features() -> Any:
    """The ``datasets.Features`` of a shard record (see the module docstring)."""
    from datasets import Features, List, Value

    return Features(
        {
            "key": Value("string"),
            "row_index": Value("int64"),
            "topk_ids": List(List(Value("int32"))),
            "topk_logprobs": List(List(Value("float16"))),
            "next_logprobs": List(Value("float16")),
        }
    )


def shard_rows(shard: int, num_rows: int, shard_size: int) -> range:
    """The training rows that shard ``shard`` holds."""
    return range(shard * shard_size, min((shard + 1) * shard_size, num_rows))


class Record(NamedTuple):
    """One row's record, as a shard stores it."""

    row_index: int
    key: str
    ids: np.ndarray  # (n, k) int32
    logprobs: np.ndarray  # (n, k) float16
    next_logprobs: np.ndarray  # (n,) float16


def records_table(records: Sequence[Record], k: int) -> pa.Table:
    """``records`` as one Arrow table with the columns of ``cache_features``."""
    offsets = pa.array(np.cumsum([0] + [len(record.next_logprobs) for record in records]).astype(np.int32))

    def nested(name: str, dtype: Any, width: int) -> pa.Array:
        empty = np.zeros((0, width) if width else (0,), dtype=dtype)
        values = np.concatenate([empty, *(getattr(record, name) for record in records)]).astype(dtype)
        inner = pa.array(values.ravel())
        if width:
            inner = pa.ListArray.from_arrays(pa.array(np.arange(0, values.size + 1, width, dtype=np.int32)), inner)
        return pa.ListArray.from_arrays(offsets, inner)

    return pa.table(
        {
            "key": pa.array([record.key for record in records], type=pa.string()),
            "row_index": pa.array([record.row_index for record in records], type=pa.int64()),
            "topk_ids": nested("ids", np.int32, k),
            "topk_logprobs": nested("logprobs", np.float16, k),
            "next_logprobs": nested("next_logprobs", np.float16, 0),
        }
    )


def write_shard(folder: Path, shard: int, records: Sequence[Record], k: int) -> Path:
    """Write one shard's records (in row order) to ``<name>.tmp``, flush it to disk, rename it into place."""
    from datasets.arrow_writer import ArrowWriter

    final = folder / shard_name(shard)
    tmp = final.with_name(final.name + ".tmp")
    writer = ArrowWriter(features=cache_features(), path=str(tmp))
    try:
        for start in range(0, len(records), CHUNK_ROWS):
            writer.write_table(records_table(records[start : start + CHUNK_ROWS], k))
        writer.finalize()
    except BaseException:
        writer.close()
        raise
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    return final


# -- fingerprints: one home for the builder and the reader ----------------------------------------------------------
def _digest(parts: Iterable[bytes]) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def row_key(ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
    """Hex blake2b-128 of a row's unpadded token ids as little-endian int32 bytes."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return _digest([np.asarray(ids, dtype="<i4").tobytes()])


def row_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    """``row_key`` of each row of a (left-)padded batch: the ids where ``attention_mask`` is 1."""
    ids, mask = input_ids.detach().cpu().numpy(), attention_mask.detach().cpu().numpy().astype(bool)
    return [row_key(row[keep]) for row, keep in zip(ids, mask, strict=True)]


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable hash of the vocabulary (token -> id, added tokens included), the special tokens and the chat
    template: what turns a conversation into the ids a cache is keyed by. The pad token is left out: padding
    never reaches the cache, and ``ChatDataModule`` sets a missing one to EOS."""
    special = {name: value for name, value in tokenizer.special_tokens_map.items() if name != "pad_token"}
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return _digest([_json(vocab), _json(special), _json(getattr(tokenizer, "chat_template", None))])


def data_fingerprint(rows: Iterable[Mapping[str, Any]]) -> str:
    """Stable hash over the rows' ``messages`` in order (JSON with sorted keys), and their count."""
    count = 0
    hasher = hashlib.blake2b(digest_size=16)
    for row in rows:
        hasher.update(_json(row["messages"]) + b"\n")
        count += 1
    hasher.update(f"rows={count}".encode())
    return hasher.hexdigest()


def teacher_identity(source: Any) -> dict[str, Any]:
    """What a cache records of its teacher: ``name_or_path`` (as ``describe_source`` gives), ``revision`` and
    ``dtype`` (a spec's ``init_kwargs``; a module's parameter dtype) and, for a local folder, ``config_hash`` (of
    its config.json)."""
    name = describe_source(source)
    revision = None
    dtype: Any = "auto"  # a folder or hub id loads in its saved dtype, as dtype "auto" does
    if isinstance(source, Mapping):
        init_kwargs = source.get("init_kwargs") or {}
        revision = init_kwargs.get("revision")
        dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype")) or "auto"
    elif isinstance(source, nn.Module):
        parameter = next(source.parameters(), None)
        dtype = None if parameter is None else parameter.dtype
    config = Path(name).expanduser() / "config.json" if name else None
    config_hash = _digest([config.read_bytes()]) if config is not None and config.is_file() else None
    return {
        "name_or_path": name,
        "revision": None if revision is None else str(revision),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "config_hash": config_hash,
    }


# -- the manifest -----------------------------------------------------------------------------------------------------
def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of the cache in ``folder``, or None when it has none."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a teacher cache manifest (format {manifest.get('format')!r}).")
    return manifest


def write_manifest(folder: str | Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` atomically (a temporary file, then a rename)."""
    path = Path(folder) / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def resume_hint(folder: str | Path, manifest: Mapping[str, Any] | None = None) -> str:
    """The command that builds (or resumes) the cache in ``folder``."""
    python = "or lightning_gkd.teachers.cache_build.build_teacher_cache(..., path=...)"
    if manifest is None:
        return f"`{BUILD_COMMAND} cache.path={folder}` with the model=/data= settings of the training run, {python}"
    return (
        f"`{BUILD_COMMAND} cache.path={folder} cache.top_k={manifest['k']}` with the model=/data= settings it was "
        f"started with (teacher {manifest['teacher']['name_or_path']}), {python}"
    )


def rebuild_hint(manifest: Mapping[str, Any]) -> str:
    """The command that builds a new cache like the one ``manifest`` describes, for this run's data."""
    return (
        f"`{BUILD_COMMAND} cache.path=<a new folder> cache.top_k={manifest['k']}` with this run's model=/data= settings"
    )


def missing_shards(folder: Path, manifest: Mapping[str, Any]) -> list[str]:
    return [shard_name(s) for s in range(int(manifest["num_shards"])) if not (folder / shard_name(s)).is_file()]


def load_complete_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a complete cache; an error naming the folder and the build/resume command otherwise."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest is None:
        raise FileNotFoundError(
            f"No teacher cache at {folder} (no {MANIFEST_NAME}). Build it with {resume_hint(folder)}."
        )
    missing = missing_shards(folder, manifest)
    if manifest.get("status") != "complete" or missing:
        raise RuntimeError(
            f"The teacher cache at {folder} is incomplete ({len(missing)} of {manifest['num_shards']} shards "
            f"missing{', first ' + missing[0] if missing else ''}): its build was stopped. Resume it with "
            f"{resume_hint(folder, manifest)}; shards already written are kept."
        )
    return manifest


class CacheMiss(LookupError):
    """A batch row that the cache does not hold."""


class CacheTeacher:
    """A ``SparseTeacher`` that reads a cache written by ``lightning_gkd.teachers.cache_build``.

    ``path``: the cache folder; its manifest is read (and the cache checked complete) here, the shards are
    memory-mapped on the first ``topk``. ``top_k``: how many tokens per position to return (None: the cache's
    ``k``; a smaller value keeps the most likely ones).
    """

    def __init__(self, path: str | Path, *, top_k: int | None = None) -> None:
        self.path = Path(path).expanduser()
        self.manifest = load_complete_manifest(self.path)
        self.k = int(self.manifest["k"])
        if top_k is None:
            top_k = self.k
        if not 1 <= top_k <= self.k:
            raise ValueError(
                f"top_k={top_k} but the teacher cache at {self.path} holds k={self.k} tokens per position: use "
                f"top_k in [1, {self.k}], or rebuild the cache with {BUILD_COMMAND} cache.top_k={top_k}."
            )
        self.top_k = top_k
        self._records: Any = None  # the concatenated Dataset (holds the memory maps)
        self._index: dict[str, int] = {}
        self._counts: np.ndarray = np.zeros(0, dtype=np.int64)

    def _table(self) -> pa.Table:
        if self._records is None:
            from datasets import Dataset, concatenate_datasets

            parts = [Dataset.from_file(str(self.path / shard["name"])) for shard in self.manifest["shards"]]
            self._records = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
            table = self._records.data.table
            for position, key in enumerate(table.column("key").to_pylist()):
                self._index.setdefault(key, position)  # duplicate rows hold the same signal
            self._counts = pc.list_value_length(table.column("next_logprobs")).to_numpy(zero_copy_only=False)
        return self._records.data.table

    def topk(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> TopKSignal:
        """The cached signal at the True ``positions`` ``(B, L)`` of ``batch`` (row-major), on its device. Raises
        ``CacheMiss`` for a row the cache does not hold (different data, or an on-policy sample)."""
        table = self._table()
        counts = positions.sum(dim=1).tolist()
        found = []
        for row, key in enumerate(row_keys(batch["input_ids"], batch["attention_mask"])):
            position = self._index.get(key)
            if position is None:
                raise CacheMiss(
                    f"Batch row {row} is not in the teacher cache at {self.path}: the training data changed "
                    "since the cache was built (rebuild it: "
                    f"{rebuild_hint(self.manifest)}), or the row is an "
                    "on-policy sample, which a cache cannot hold (train with lmbda=0 or a live teacher)."
                )
            if int(self._counts[position]) != counts[row]:
                raise ValueError(
                    f"Batch row {row} has {counts[row]} supervised positions but the teacher cache at {self.path} "
                    f"holds {int(self._counts[position])} for it (row {self._row_index(position)}): the labels "
                    "are masked differently from the collation the cache was built with."
                )
            found.append(position)
        taken = table.take(pa.array(found, type=pa.int64()))
        n = sum(counts)
        ids = _flat(taken, "topk_ids", 2).reshape(n, self.k)[:, : self.top_k]
        logprobs = _flat(taken, "topk_logprobs", 2).reshape(n, self.k)[:, : self.top_k]
        following = _flat(taken, "next_logprobs", 1)
        device = batch["input_ids"].device
        return TopKSignal(
            torch.from_numpy(ids.astype(np.int64)).to(device),
            torch.from_numpy(logprobs.astype(np.float32)).to(device),
            torch.from_numpy(following.astype(np.float32)).to(device),
        )

    def _row_index(self, position: int) -> int:
        return int(self._table().column("row_index")[position].as_py())

    def check(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        """The student's tokenizer must be the one the cache was built with, and its vocabulary hold every id."""
        fingerprint = tokenizer_fingerprint(tokenizer)
        if fingerprint != self.manifest["tokenizer_fingerprint"]:
            raise ValueError(
                f"The teacher cache at {self.path} was built with a tokenizer of fingerprint "
                f"{self.manifest['tokenizer_fingerprint']}, but the student's tokenizer "
                f"({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has {fingerprint}: its "
                "token ids mean other tokens. Use the tokenizer the cache was built with, or rebuild the cache: "
                f"{rebuild_hint(self.manifest)}."
            )
        if int(self.manifest["max_token_id"]) >= vocab_size:
            raise ValueError(
                f"The teacher cache at {self.path} holds token id {self.manifest['max_token_id']}, outside the "
                f"student's vocabulary of {vocab_size}."
            )

    def check_datamodule(self, datamodule: Any) -> None:
        """The data must be what the cache was built over: ``max_length`` and the fingerprint of the training then
        validation rows (``lightning_gkd.data.rows.fit_rows``), each row's last assistant turn."""
        refuse_every_assistant_turn(datamodule)
        max_length = getattr(datamodule, "max_length", None)
        if max_length != self.manifest["max_length"]:
            raise ValueError(
                f"The teacher cache at {self.path} was built with max_length={self.manifest['max_length']}, the "
                f"data has max_length={max_length} (data.max_length): rebuild the cache for it: "
                f"{rebuild_hint(self.manifest)}."
            )
        rows = fit_rows(datamodule)
        fingerprint = data_fingerprint(rows)
        if fingerprint != self.manifest["data_fingerprint"]:
            raise ValueError(
                f"The teacher cache at {self.path} was built over {self.manifest['num_rows']} rows (training, then "
                f"validation) of fingerprint {self.manifest['data_fingerprint']}; the data has {len(rows)} rows of "
                f"fingerprint {fingerprint}. Rebuild the cache over this data: "
                f"{rebuild_hint(self.manifest)}."
            )


def _flat(table: pa.Table, column: str, depth: int) -> np.ndarray:
    """The values of a (nested) list column, concatenated row-major."""
    chunks = []
    for chunk in table.column(column).chunks:
        for _ in range(depth):
            chunk = chunk.flatten()
        chunks.append(chunk.to_numpy(zero_copy_only=False))
    return np.concatenate(chunks) if chunks else np.zeros(0)


def refuse_every_assistant_turn(datamodule: Any) -> None:
    """A cache holds the teacher's signal on each row's last assistant turn (what validation scores too); training on
    every turn (``data.assistant_turns=all``) would find no teacher signal at the earlier turns."""
    if getattr(datamodule, "assistant_turns", "last") != "last":
        raise ValueError(
            "teacher=cache holds the teacher's signal on each row's last assistant turn, but data.assistant_turns="
            f"{datamodule.assistant_turns!r} trains on every assistant turn. Use data.assistant_turns=last with the "
            "cache, or a teacher that scores any position (teacher=local or teacher=server)."
        )
