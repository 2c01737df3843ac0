"""An offline teacher: the teacher's signal precomputed over the training rows (``lightning_gkd.teachers.cache_build``,
``lightning-gkd-cache``) and read back here, so distillation needs no teacher forward. Two signals
(``manifest.json``'s ``signal``; absent means ``topk``):

- ``topk``: top-k log-probs, read as a ``SparseTeacher`` (``CacheTeacher``);
- ``hidden``: the teacher's final hidden states (after the final norm) plus its head (``head.safetensors``), read as
  an exact dense ``Teacher`` (``HiddenCacheTeacher``): the full distributions at 2H bytes per supervised token.

``open_teacher_cache(path)`` opens either, by the manifest.

Format: a folder with ``manifest.json`` and Arrow shards ``shard-00000.arrow``, ``shard-00001.arrow``, ... (Hugging
Face ``datasets`` Arrow stream files, written with ``datasets.arrow_writer.ArrowWriter``; ``Dataset.from_file``
memory-maps them). Shard ``s`` holds training rows ``s * shard_size`` up to ``(s + 1) * shard_size``, in row order,
one record per row (``cache_features``):

- ``key`` string: ``row_key`` of the row's unpadded token ids (finds the row whatever the batch order);
- ``row_index`` int64: the row's index in the training rows;
- ``signal=topk``: ``topk_ids`` list<list<int32>> ``(n, k)`` and ``topk_logprobs`` list<list<float16>> ``(n, k)``:
  at each of the row's ``n`` supervised positions (``supervised_positions``, row order), the teacher's ``k`` most
  likely next tokens and their log-probs, most likely first; ``next_logprobs`` list<float16> ``(n,)``: the
  teacher's log-prob of the token that follows each position;
- ``signal=hidden``: ``hidden`` list<list<float16>> ``(n, H)`` (``hidden_dtype=float16``) or list<list<uint16>>
  (``hidden_dtype=bfloat16``: each number's bfloat16 bits), the teacher's final hidden states at the row's ``n``
  supervised positions, row order. ``head.safetensors`` holds the head once: ``weight`` ``(V, H)`` and ``bias``
  ``(V,)`` if it has one, in the teacher's dtype, so that ``softcap(scale · (h Wᵀ + b))`` are the teacher's logits.

``manifest.json``: ``format``, ``format_version``, ``status`` ("building" until every shard is written, then
"complete"), the settings (``signal``, ``k`` (null for hidden), ``hidden_dtype`` (null for topk), ``teacher``
{name_or_path, revision, dtype, config_hash}, ``precision``, ``tokenizer_fingerprint``, ``data_fingerprint``,
``max_length``, ``num_rows``, ``shard_size``, ``num_shards``) and, once complete, ``shards`` [{name, rows, tokens,
bytes}], ``total_tokens`` (supervised), ``total_bytes`` (the shards), ``max_token_id`` (topk; null for hidden),
``head`` (hidden: {scale, softcap, hidden_size, vocab_size, dtype, bytes}; null for topk) and
``bytes_per_million_tokens`` (the shards). No timestamps: the same rows give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.rows import fit_rows
from lightning_gkd.data.tokenizer import tokenizer_fingerprint
from lightning_gkd.evaluation.model_card import describe_source
from lightning_gkd.ops.hf.heads import LogitHead
from lightning_gkd.teachers.base import TeacherBase, TopKSignal
from lightning_gkd.teachers.hidden import HiddenStateTeacher

FORMAT = "lightning_gkd.teacher_cache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEAD_NAME = "head.safetensors"
BUILD_COMMAND = "lightning-gkd-cache"
#: rows per Arrow record batch in a shard at most (keeps list offsets far below int32's range) ...
CHUNK_ROWS = 256
#: ... and numbers per record batch at most (a hidden-state row holds n × H of them)
CHUNK_VALUES = 1 << 27

#: What a cache holds: top-k log-probs (a sparse teacher) or final hidden states plus the head (a dense one).
Signal = Literal["topk", "hidden"]
SIGNALS: tuple[str, ...] = get_args(Signal)
#: How a hidden-state cache stores each number: float16 (Arrow's own), or bfloat16 as its uint16 bits.
HiddenDtype = Literal["float16", "bfloat16"]
HIDDEN_DTYPES: tuple[str, ...] = get_args(HiddenDtype)
#: float16's largest finite number: a hidden state beyond it cannot be stored as float16
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.arrow"


def check_signal(signal: str, hidden_dtype: str) -> None:
    """``signal`` and ``hidden_dtype`` name what a cache can hold (the ``cache.signal``/``cache.hidden_dtype`` keys)."""
    if signal not in SIGNALS:
        raise ValueError(f"cache.signal must be one of {', '.join(SIGNALS)}, got {signal!r}.")
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"cache.hidden_dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {hidden_dtype!r}.")


def manifest_signal(manifest: Mapping[str, Any]) -> str:
    """The signal a manifest describes (caches written before hidden states existed have none: ``topk``)."""
    return str(manifest.get("signal") or "topk")


def cache_features(signal: str = "topk", hidden_dtype: str = "float16") -> Any:
    """The ``datasets.Features`` of a shard record (see the module docstring)."""
    from datasets import Features, List, Value

    if signal == "hidden":
        stored = "float16" if hidden_dtype == "float16" else "uint16"
        return Features({"key": Value("string"), "row_index": Value("int64"), "hidden": List(List(Value(stored)))})
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
    """One row's top-k record, as a shard stores it."""

    row_index: int
    key: str
    ids: np.ndarray  # (n, k) int32
    logprobs: np.ndarray  # (n, k) float16
    next_logprobs: np.ndarray  # (n,) float16

    @property
    def positions(self) -> int:
        return len(self.next_logprobs)


class HiddenRecord(NamedTuple):
    """One row's hidden-state record, as a shard stores it."""

    row_index: int
    key: str
    hidden: np.ndarray  # (n, H) float16, or uint16 (bfloat16 bits)

    @property
    def positions(self) -> int:
        return len(self.hidden)


#: the nested columns of each record type: (column, record field, numpy dtype or None to keep it, 2-D)
_NESTED: dict[type, tuple[tuple[str, str, Any, bool], ...]] = {
    Record: (
        ("topk_ids", "ids", np.int32, True),
        ("topk_logprobs", "logprobs", np.float16, True),
        ("next_logprobs", "next_logprobs", np.float16, False),
    ),
    HiddenRecord: (("hidden", "hidden", None, True),),
}


def records_table(records: Sequence[Record | HiddenRecord], width: int) -> pa.Table:
    """``records`` (one type, at least one) as one Arrow table with the columns of ``cache_features``; ``width``: the
    inner length (``k``, or the hidden size ``H``)."""
    offsets = pa.array(np.cumsum([0] + [record.positions for record in records]).astype(np.int32))

    def nested(field: str, dtype: Any, matrix: bool) -> pa.Array:
        arrays = [getattr(record, field) for record in records]
        dtype = arrays[0].dtype if dtype is None else dtype
        empty = np.zeros((0, width) if matrix else (0,), dtype=dtype)
        values = np.concatenate([empty, *arrays]).astype(dtype, copy=False)
        inner = pa.array(values.ravel())
        if matrix:
            inner = pa.ListArray.from_arrays(pa.array(np.arange(0, values.size + 1, width, dtype=np.int32)), inner)
        return pa.ListArray.from_arrays(offsets, inner)

    columns = {
        "key": pa.array([record.key for record in records], type=pa.string()),
        "row_index": pa.array([record.row_index for record in records], type=pa.int64()),
    }
    for column, field, dtype, matrix in _NESTED[type(records[0])]:
        columns[column] = nested(field, dtype, matrix)
    return pa.table(columns)


def record_chunks(records: Sequence[Record | HiddenRecord], width: int) -> Iterator[Sequence[Record | HiddenRecord]]:
    """``records`` in consecutive runs of at most ``CHUNK_ROWS`` rows and ``CHUNK_VALUES`` numbers (a row is never
    split), each one Arrow record batch."""
    start, values = 0, 0
    for end, record in enumerate(records):
        size = record.positions * width
        if end > start and (end - start == CHUNK_ROWS or values + size > CHUNK_VALUES):
            yield records[start:end]
            start, values = end, 0
        values += size
    if start < len(records):
        yield records[start:]


def write_shard(
    folder: Path,
    shard: int,
    records: Sequence[Record | HiddenRecord],
    width: int,
    *,
    signal: str = "topk",
    hidden_dtype: str = "float16",
) -> Path:
    """Write one shard's records (in row order; ``width``: ``k``, or ``H`` for hidden states) to ``<name>.tmp``,
    flush it to disk, rename it into place."""
    from datasets.arrow_writer import ArrowWriter

    if not records:
        raise ValueError(f"write_shard: shard {shard} has no records.")
    final = folder / shard_name(shard)
    tmp = final.with_name(final.name + ".tmp")
    writer = ArrowWriter(features=cache_features(signal, hidden_dtype), path=str(tmp))
    try:
        for chunk in record_chunks(records, width):
            writer.write_table(records_table(chunk, width))
        writer.finalize()
    except BaseException:
        writer.close()
        raise
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    return final


# -- hidden states and the head ---------------------------------------------------------------------------------------
def encode_hidden(hidden: torch.Tensor, hidden_dtype: str, *, where: str = "") -> np.ndarray:
    """``(N, H)`` hidden states as a shard stores them: float16, or bfloat16's bits as uint16. Raises ``ValueError``
    for float16 when a number is beyond float16's range (|h| > 65504; bfloat16 has float32's range); ``where``: which
    rows, for that message."""
    if hidden_dtype == "bfloat16":
        return hidden.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
    largest = float(hidden.detach().abs().max()) if hidden.numel() else 0.0
    if largest > FLOAT16_MAX:
        raise ValueError(
            f"A teacher hidden state{where} is {largest:.6g} in magnitude, beyond float16's range (|h| <= "
            f"{FLOAT16_MAX:g}): it cannot be cached as float16. Build the cache with cache.hidden_dtype=bfloat16 "
            "(float32's range, 8 bits of mantissa) into a new cache.path, or empty this one first (its manifest "
            "records float16)."
        )
    return hidden.detach().to(torch.float16).cpu().numpy()


def decode_hidden(values: np.ndarray, hidden_dtype: str) -> torch.Tensor:
    """The inverse of ``encode_hidden``: a float16 or bfloat16 tensor (CPU) of the stored numbers."""
    if hidden_dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.uint16).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float16))


def head_description(head: LogitHead) -> dict[str, Any]:
    """What a manifest records of a head besides its tensors (``scale``, ``softcap``, shape and dtype)."""
    return {
        "scale": float(head.scale),
        "softcap": None if head.softcap is None else float(head.softcap),
        "hidden_size": int(head.weight.shape[1]),
        "vocab_size": int(head.weight.shape[0]),
        "dtype": str(head.weight.dtype).removeprefix("torch."),
    }


#: the one safetensors metadata key of ``head.safetensors``: its ``head_description`` as JSON (one key: stable bytes)
_HEAD_METADATA = "lightning_gkd.head"


def write_head(folder: str | Path, head: LogitHead) -> Path:
    """Write ``head`` to ``<folder>/head.safetensors`` atomically: ``weight`` (and ``bias``) in their dtype, its
    ``head_description`` in the file's metadata (read back by ``read_head_description``)."""
    from safetensors.torch import save_file

    tensors = {"weight": head.weight.detach().cpu().contiguous()}
    if head.bias is not None:
        tensors["bias"] = head.bias.detach().cpu().contiguous()
    path = Path(folder) / HEAD_NAME
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={_HEAD_METADATA: json.dumps(head_description(head), sort_keys=True)})
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def read_head_description(folder: str | Path) -> dict[str, Any]:
    """The ``head_description`` stored in ``<folder>/head.safetensors`` (and the file's size, ``bytes``)."""
    from safetensors import safe_open

    path = Path(folder) / HEAD_NAME
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if _HEAD_METADATA not in metadata:
        raise ValueError(f"{path} is not a teacher cache's head (no {_HEAD_METADATA!r} metadata).")
    return {**json.loads(metadata[_HEAD_METADATA]), "bytes": path.stat().st_size}


def read_head(folder: str | Path, manifest: Mapping[str, Any]) -> LogitHead:
    """The head of the hidden-state cache in ``folder`` (``head.safetensors``, checked against ``manifest['head']``)."""
    from safetensors.torch import load_file

    path = Path(folder) / HEAD_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"The hidden-state teacher cache at {folder} has no {HEAD_NAME} (the teacher's head): rebuild it with "
            f"{rebuild_hint(manifest)}."
        )
    tensors = load_file(str(path))
    description = manifest["head"]
    head = LogitHead(tensors["weight"], tensors.get("bias"), float(description["scale"]), description["softcap"])
    found = {key: value for key, value in head_description(head).items() if key in description}
    expected = {key: description[key] for key in found}
    if found != expected:
        raise ValueError(
            f"{path} holds a head {found}, but the cache's manifest describes {expected}: the folder mixes two "
            f"builds. Rebuild it with {rebuild_hint(manifest)}."
        )
    return head


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


#: Rows ``data_fingerprint`` hashes, evenly spaced over the data (every row of smaller data).
FINGERPRINT_ROWS = 4096


def data_fingerprint(rows: Sequence[Mapping[str, Any]]) -> str:
    """Stable hash of the rows' count and the ``messages`` (JSON with sorted keys) of at most ``FINGERPRINT_ROWS``
    rows evenly spaced over them, each with its index: every row of small data, a fixed cost on large data
    (0.02 s at 1M rows against 4.3 s to hash them all, toy rows). A changed row that is not sampled is still
    found: the cache finds each batch row by the key of its token ids, and a row it does not hold is an error
    when its batch is read."""
    count = len(rows)
    step = max(1, -(-count // FINGERPRINT_ROWS))
    hasher = hashlib.blake2b(digest_size=16)
    for index in range(0, count, step):
        hasher.update(f"{index}:".encode() + _json(rows[index]["messages"]) + b"\n")
    hasher.update(f"rows={count}".encode())
    return hasher.hexdigest()


#: What ``weights_fingerprint`` reads of each weight file: this many blocks of ``SAMPLE_BYTES``, evenly spaced.
SAMPLE_BLOCKS, SAMPLE_BYTES = 8, 64 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _file_digest(path: Path, hasher: Any) -> None:
    """Feed ``hasher`` the file's name and size, a safetensors file's JSON header (the tensors' names, dtypes,
    shapes and offsets), and ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` evenly spaced over it: never the whole
    file."""
    size = path.stat().st_size
    hasher.update(f"{path.name}:{size}\n".encode())
    with open(path, "rb") as handle:
        if path.suffix == ".safetensors" and size >= 8:
            length = int.from_bytes(handle.read(8), "little")
            hasher.update(handle.read(min(length, size - 8)))
        for block in range(SAMPLE_BLOCKS):
            handle.seek(max(0, size - SAMPLE_BYTES) * block // max(1, SAMPLE_BLOCKS - 1))
            hasher.update(handle.read(SAMPLE_BYTES))


def weights_fingerprint(source: Any) -> str | None:
    """A cheap identity of a teacher's weights: for a local folder, its weight files (``_file_digest``: sizes,
    safetensors headers, sampled blocks); for an ``nn.Module``, each parameter's name, shape and dtype and up to 1024
    evenly strided values; None for a hub id (its ``revision`` identifies it)."""
    hasher = hashlib.blake2b(digest_size=16)
    if isinstance(source, nn.Module):
        for name, parameter in source.named_parameters():
            flat = parameter.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)].float().cpu().numpy().tobytes()
            hasher.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}\n".encode() + sample)
        return hasher.hexdigest()
    described = describe_source(source)
    folder = Path(described).expanduser() if described else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    for path in files:
        _file_digest(path, hasher)
    return hasher.hexdigest()


def teacher_identity(source: Any) -> dict[str, Any]:
    """What a cache records of its teacher: ``name_or_path`` (as ``describe_source`` gives), ``revision`` and
    ``dtype`` (a spec's ``init_kwargs``; a module's parameter dtype), for a local folder ``config_hash`` (of
    its config.json), and ``weights_fingerprint`` (``weights_fingerprint``: a cache made by other weights in the
    same folder is refused)."""
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
        "weights_fingerprint": weights_fingerprint(source),
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


def signal_flags(manifest: Mapping[str, Any]) -> str:
    """The ``lightning-gkd-cache`` keys that choose what ``manifest``'s cache holds."""
    if manifest_signal(manifest) == "hidden":
        return f"cache.signal=hidden cache.hidden_dtype={manifest['hidden_dtype']}"
    return f"cache.top_k={manifest['k']}"


def resume_hint(folder: str | Path, manifest: Mapping[str, Any] | None = None) -> str:
    """The command that builds (or resumes) the cache in ``folder``."""
    python = "or lightning_gkd.teachers.cache_build.build_teacher_cache(..., path=...)"
    if manifest is None:
        return f"`{BUILD_COMMAND} cache.path={folder}` with the model=/data= settings of the training run, {python}"
    return (
        f"`{BUILD_COMMAND} cache.path={folder} {signal_flags(manifest)}` with the model=/data= settings it was "
        f"started with (teacher {manifest['teacher']['name_or_path']}), {python}"
    )


def rebuild_hint(manifest: Mapping[str, Any]) -> str:
    """The command that builds a new cache like the one ``manifest`` describes, for this run's data."""
    return f"`{BUILD_COMMAND} cache.path=<a new folder> {signal_flags(manifest)}` with this run's model=/data= settings"


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


class CacheReader(TeacherBase):
    """What both cache teachers share: the complete manifest (read and checked here), the memory-mapped shards
    (opened on the first lookup), each batch row found by ``row_key``, and the checks of the student's tokenizer and
    of the data. ``signal``: what the reading class reads; a cache holding the other is refused, naming the class
    that reads it."""

    #: the list column whose lengths are each row's supervised positions
    count_column = "next_logprobs"

    def __init__(self, path: str | Path, *, signal: str) -> None:
        self.path = Path(path).expanduser()
        self.manifest = load_complete_manifest(self.path)
        found = manifest_signal(self.manifest)
        if found != signal:
            reader = {"topk": "CacheTeacher", "hidden": "HiddenCacheTeacher"}.get(found, "open_teacher_cache")
            raise ValueError(
                f"The teacher cache at {self.path} holds signal={found}, not {signal}: read it with {reader} "
                "(lightning_gkd.teachers.cache.open_teacher_cache picks the reader from the manifest)."
            )
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
            self._counts = pc.list_value_length(table.column(self.count_column)).to_numpy(zero_copy_only=False)
        return self._records.data.table

    def _rows(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> tuple[pa.Table, int]:
        """The records of ``batch``'s rows in batch order, and their supervised positions in all. Raises
        ``CacheMiss`` for a row the cache does not hold (different data, or an on-policy sample), ``ValueError``
        for a row whose labels mark other positions than the cache holds."""
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
        return table.take(pa.array(found, type=pa.int64())), sum(counts)

    def _row_index(self, position: int) -> int:
        return int(self._table().column("row_index")[position].as_py())

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """The student's tokenizer must be the one the cache was built with (its ids key the rows)."""
        fingerprint = tokenizer_fingerprint(tokenizer)
        if fingerprint != self.manifest["tokenizer_fingerprint"]:
            raise ValueError(
                f"The teacher cache at {self.path} was built with a tokenizer of fingerprint "
                f"{self.manifest['tokenizer_fingerprint']}, but the student's tokenizer "
                f"({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has {fingerprint}: its "
                "token ids mean other tokens. Use the tokenizer the cache was built with, or rebuild the cache: "
                f"{rebuild_hint(self.manifest)}."
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


class CacheTeacher(CacheReader):
    """A ``SparseTeacher`` that reads a top-k cache written by ``lightning_gkd.teachers.cache_build``.

    ``path``: the cache folder; its manifest is read (and the cache checked complete) here, the shards are
    memory-mapped on the first ``topk``. ``top_k``: how many tokens per position to return (None: the cache's
    ``k``; a smaller value keeps the most likely ones).
    """

    def __init__(self, path: str | Path, *, top_k: int | None = None) -> None:
        super().__init__(path, signal="topk")
        self.k = int(self.manifest["k"])
        if top_k is None:
            top_k = self.k
        if not 1 <= top_k <= self.k:
            raise ValueError(
                f"top_k={top_k} but the teacher cache at {self.path} holds k={self.k} tokens per position: use "
                f"top_k in [1, {self.k}], or rebuild the cache with {BUILD_COMMAND} cache.top_k={top_k}."
            )
        self.top_k = top_k
        rows = self.manifest.get("vocab_rows")
        #: The token ids ``[0, vocab_rows)`` the cached log-probs are normalised over (None: not recorded).
        self.vocab_rows: int | None = None if rows is None else int(rows)

    def topk(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> TopKSignal:
        """The cached signal at the True ``positions`` ``(B, L)`` of ``batch`` (row-major), on its device. Raises
        ``CacheMiss`` for a row the cache does not hold (different data, or an on-policy sample)."""
        taken, n = self._rows(batch, positions)
        ids = _flat(taken, "topk_ids", 2).reshape(n, self.k)[:, : self.top_k]
        logprobs = _flat(taken, "topk_logprobs", 2).reshape(n, self.k)[:, : self.top_k]
        following = _flat(taken, "next_logprobs", 1)
        device = batch["input_ids"].device
        return TopKSignal(
            torch.from_numpy(ids.astype(np.int64)).to(device),
            torch.from_numpy(logprobs.astype(np.float32)).to(device),
            torch.from_numpy(following.astype(np.float32)).to(device),
        )

    def check(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        """The student's tokenizer must be the one the cache was built with, its vocabulary hold every id, and the
        cached log-probs be normalised over the ids the run compares (``vocab_size``: the rows the student and
        teachers share)."""
        self.check_tokenizer(tokenizer)
        if self.vocab_rows is not None and self.vocab_rows > vocab_size:
            raise ValueError(
                f"The teacher cache at {self.path} holds the teacher's top-k over token ids [0, {self.vocab_rows}), "
                f"but this run compares the ids [0, {vocab_size}) the student's vocabulary has: its log-probs are "
                f"normalised over rows the student lacks. Rebuild it with {BUILD_COMMAND} cache.vocab_rows="
                f"{vocab_size} (or give model.student, whose rows it then takes)."
            )
        if int(self.manifest["max_token_id"]) >= vocab_size:
            raise ValueError(
                f"The teacher cache at {self.path} holds token id {self.manifest['max_token_id']}, outside the "
                f"student's vocabulary of {vocab_size}."
            )


class HiddenCacheTeacher(CacheReader, HiddenStateTeacher):
    """A dense ``Teacher`` that reads a hidden-state cache (``cache.signal=hidden``) written by
    ``lightning_gkd.teachers.cache_build``: the teacher's final hidden states at each batch row's supervised
    positions (float16 or bfloat16 as stored, cast to the head's dtype on the batch's device) and its head from
    ``head.safetensors``, so ``hidden_states`` and ``logits`` give exactly the teacher's full distributions (up to the
    storage's rounding) with no teacher model.

    ``path``: the cache folder; its manifest and head are read (and the cache checked complete) here, the shards are
    memory-mapped on the first ``hidden_states``. Only the positions a cache holds can be read: ``positions`` must be
    the batch's supervised positions (``supervised_positions(batch["labels"])``)."""

    count_column = "hidden"

    def __init__(self, path: str | Path) -> None:
        CacheReader.__init__(self, path, signal="hidden")
        self.hidden_dtype = str(self.manifest["hidden_dtype"])
        HiddenStateTeacher.__init__(self, read_head(self.path, self.manifest))

    def read_states(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` the cached hidden states at the True ``positions`` ``(B, L)`` of ``batch`` (row-major), float16
        or bfloat16 on the CPU. Raises ``CacheMiss`` for a row the cache does not hold."""
        taken, n = self._rows(batch, positions)
        return decode_hidden(_flat(taken, "hidden", 2).reshape(n, self.hidden_size), self.hidden_dtype)

    def check(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        """The student's tokenizer must be the one the cache was built with, and its vocabulary the head's (the
        dense losses compare the two distributions token by token)."""
        self.check_tokenizer(tokenizer)
        if self.vocab_size != vocab_size:
            raise ValueError(
                f"The hidden-state teacher cache at {self.path} holds a teacher head over {self.vocab_size} tokens, "
                f"but the run compares {vocab_size} token ids: the dense losses need the same vocabulary."
            )


def open_teacher_cache(path: str | Path, top_k: int | None = None) -> CacheTeacher | HiddenCacheTeacher:
    """The reader of the cache in ``path``, by its manifest's ``signal``: ``CacheTeacher`` (``topk``, or no signal)
    reading ``top_k`` tokens per position, or ``HiddenCacheTeacher`` (``hidden``), which takes no ``top_k``."""
    signal = manifest_signal(load_complete_manifest(path))
    if signal == "hidden":
        if top_k is not None:
            raise ValueError(
                f"top_k={top_k}, but the teacher cache at {Path(path).expanduser()} holds hidden states: a "
                "hidden-state cache gives full distributions; set teacher.top_k=null."
            )
        return HiddenCacheTeacher(path)
    return CacheTeacher(path, top_k=top_k)


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
