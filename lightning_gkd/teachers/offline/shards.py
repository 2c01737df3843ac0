"""A teacher cache's shard files (``shard-00000.arrow``, ...; their records: ``teachers.offline.format``): Arrow
tables of records written in bounded record batches, and memory-mapped back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from lightning_gkd.teachers.offline.format import HiddenRecord, Record, cache_features

#: rows per Arrow record batch in a shard at most (keeps list offsets far below int32's range) ...
CHUNK_ROWS = 256
#: ... and numbers per record batch at most (a hidden-state row holds n × H of them)
CHUNK_VALUES = 1 << 27


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.arrow"


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


def write_shard_file(
    path: Path,
    records: Sequence[Record | HiddenRecord],
    width: int,
    *,
    signal: str = "topk",
    hidden_dtype: str = "float16",
) -> None:
    """Write one shard's records (in row order; ``width``: ``k``, or ``H`` for hidden states) to ``path`` (as it is:
    the build writes it to a temporary name and renames it, ``teachers.offline.sharded_writer``)."""
    from datasets.arrow_writer import ArrowWriter

    if not records:
        raise ValueError(f"write_shard_file: {path.name} has no records.")
    writer = ArrowWriter(features=cache_features(signal, hidden_dtype), path=str(path))
    try:
        for chunk in record_chunks(records, width):
            writer.write_table(records_table(chunk, width))
        writer.finalize()
    except BaseException:
        writer.close()
        raise


def read_shards(paths: Sequence[Path]) -> Any:
    """The records of the shard files ``paths`` (at least one), in order, as one memory-mapped ``datasets.Dataset``
    (its Arrow table: ``.data.table``; the Dataset holds the memory maps)."""
    from datasets import Dataset, concatenate_datasets

    parts = [Dataset.from_file(str(path)) for path in paths]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def flat_values(table: pa.Table, column: str, depth: int) -> np.ndarray:
    """The values of a (nested) list column, concatenated row-major."""
    chunks = []
    for chunk in table.column(column).chunks:
        for _ in range(depth):
            chunk = chunk.flatten()
        chunks.append(chunk.to_numpy(zero_copy_only=False))
    return np.concatenate(chunks) if chunks else np.zeros(0)
