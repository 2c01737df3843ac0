"""What a teacher cache is: the teacher's signal precomputed over the training rows (``teachers.offline.build``,
``lightning-gkd-cache``) and read back (``teachers.offline.reader``), so distillation needs no teacher forward. Two
signals (``manifest.json``'s ``signal``; absent means ``topk``):

- ``topk``: top-k log-probs, read as a ``SparseTeacher`` (``CacheTeacher``);
- ``hidden``: the teacher's final hidden states (after the final norm) plus its head (``head.safetensors``), read as
  an exact dense ``Teacher`` (``HiddenCacheTeacher``): the full distributions at 2H bytes per supervised token.

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

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import torch

FORMAT = "lightning_gkd.teacher_cache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEAD_NAME = "head.safetensors"
BUILD_COMMAND = "lightning-gkd-cache"

#: What a cache holds: top-k log-probs (a sparse teacher) or final hidden states plus the head (a dense one).
Signal = Literal["topk", "hidden"]
SIGNALS: tuple[str, ...] = get_args(Signal)
#: How a hidden-state cache stores each number: float16 (Arrow's own), or bfloat16 as its uint16 bits.
HiddenDtype = Literal["float16", "bfloat16"]
HIDDEN_DTYPES: tuple[str, ...] = get_args(HiddenDtype)
#: float16's largest finite number: a hidden state beyond it cannot be stored as float16
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


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
