"""The teacher cache's format on disk (lightning_gkd/teachers/offline/format.py): caches written by earlier code
still read, and today's code writes the same bytes.

``stored/`` holds three small caches (top-k; hidden states as float16, no bias; as bfloat16, with a bias, a scale
and a soft-cap) written from synthetic records, no model, by ``write_stored_caches`` with the code of 426f4bf (before
the cache moved into ``teachers/offline/``). The reader must give exactly the stored numbers, and the writer must
write those files again byte for byte: a change of the format (a column, a dtype, the chunking, a manifest key) or
of a dependency's Arrow bytes fails here. If a dependency changes the bytes, the read test still passing says old
caches still load; regenerate ``stored/`` with ``python tests/teachers/offline/test_format.py`` only then.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_gkd.ops.hf.heads import LogitHead
from lightning_gkd.teachers.base import supervised_positions
from lightning_gkd.teachers.offline.build import finalize_cache
from lightning_gkd.teachers.offline.fingerprints import row_key
from lightning_gkd.teachers.offline.format import HiddenRecord, Record, encode_hidden
from lightning_gkd.teachers.offline.head import write_head
from lightning_gkd.teachers.offline.reader import CacheTeacher, HiddenCacheTeacher, open_teacher_cache
from lightning_gkd.teachers.offline.shards import shard_name, write_shard_file

STORED = Path(__file__).parent / "stored"
#: the synthetic rows' token ids, and how many supervised positions each has (its last ones)
ROW_IDS = [[5, 7, 9, 2], [5, 8, 3], [6, 6, 6, 6, 1], [4, 2], [9, 9, 8, 7, 6, 5]]
SUPERVISED = [2, 1, 3, 1, 4]
K, VOCAB, HIDDEN, SHARD_SIZE = 3, 11, 4, 2
#: cache folder -> (signal, hidden_dtype)
CACHES = {"topk": ("topk", "float16"), "hidden_fp16": ("hidden", "float16"), "hidden_bf16": ("hidden", "bfloat16")}


def topk_values(row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row ``row``'s ids ``(n, K)``, log-probs ``(n, K)`` and next-token log-probs ``(n,)``: exact in float16."""
    n = SUPERVISED[row]
    i, j = np.meshgrid(np.arange(n), np.arange(K), indexing="ij")
    ids = ((row + 3 * i + j) % VOCAB).astype(np.int32)
    logprobs = (-(i + j + 1) / 8).astype(np.float16)
    return ids, logprobs, (-(row + np.arange(n)) / 4).astype(np.float16)


def hidden_values(row: int, hidden_dtype: str) -> torch.Tensor:
    """Row ``row``'s hidden states ``(n, H)``; beyond float16's range for the bfloat16 cache."""
    n = SUPERVISED[row]
    values = torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN) / 4 - row
    return values * 2.0**20 if hidden_dtype == "bfloat16" else values


def head(hidden_dtype: str) -> LogitHead:
    weight = torch.arange(VOCAB * HIDDEN, dtype=torch.float32).reshape(VOCAB, HIDDEN) / 64 - 0.25
    if hidden_dtype == "bfloat16":
        return LogitHead(weight, torch.arange(VOCAB, dtype=torch.float32) / 16, 0.5, 30.0)
    return LogitHead(weight, None, 1.0, None)


def settings(signal: str, hidden_dtype: str) -> dict[str, Any]:
    hidden = signal == "hidden"
    return {
        "signal": signal,
        "k": None if hidden else K,
        "vocab_rows": VOCAB,
        "hidden_dtype": hidden_dtype if hidden else None,
        "teacher": {
            "name_or_path": "synthetic",
            "revision": None,
            "dtype": "float32",
            "config_hash": None,
            "weights_fingerprint": None,
        },
        "precision": "32-true",
        "tokenizer_fingerprint": "0" * 32,
        "data_fingerprint": "1" * 32,
        "max_length": 8,
        "num_rows": len(ROW_IDS),
        "shard_size": SHARD_SIZE,
        "num_shards": -(-len(ROW_IDS) // SHARD_SIZE),
    }


def write_stored_caches(root: Path) -> None:
    """The three caches of ``stored/``, written through the cache's own writers."""
    for name, (signal, hidden_dtype) in CACHES.items():
        folder = root / name
        folder.mkdir(parents=True)
        if signal == "hidden":
            write_head(folder, head(hidden_dtype))
        config = settings(signal, hidden_dtype)
        for shard in range(config["num_shards"]):
            records: list[Record | HiddenRecord] = []
            for row in range(shard * SHARD_SIZE, min((shard + 1) * SHARD_SIZE, len(ROW_IDS))):
                if signal == "hidden":
                    stored = encode_hidden(hidden_values(row, hidden_dtype), hidden_dtype)
                    records.append(HiddenRecord(row, row_key(ROW_IDS[row]), stored))
                else:
                    records.append(Record(row, row_key(ROW_IDS[row]), *topk_values(row)))
            width = HIDDEN if signal == "hidden" else K
            write_shard_file(folder / shard_name(shard), records, width, signal=signal, hidden_dtype=hidden_dtype)
        finalize_cache(folder, config)


def batch(rows: list[int]) -> dict[str, torch.Tensor]:
    """``rows`` left-padded as the collator pads them, their last ``SUPERVISED`` tokens labelled."""
    width = max(len(ROW_IDS[row]) for row in rows) + 1
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for b, row in enumerate(rows):
        ids = torch.tensor(ROW_IDS[row])
        input_ids[b, width - len(ids) :] = ids
        attention_mask[b, width - len(ids) :] = 1
        labels[b, width - SUPERVISED[row] :] = ids[-SUPERVISED[row] :]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


ORDER = [3, 0, 4, 1, 2]  # any order: each row found by the key of its ids


def test_the_stored_top_k_cache_reads_its_numbers():
    cache = open_teacher_cache(STORED / "topk")
    assert isinstance(cache, CacheTeacher) and cache.k == K and cache.vocab_rows == VOCAB
    data = batch(ORDER)
    signal = cache.topk(data, supervised_positions(data["labels"]))
    ids, logprobs, following = (np.concatenate(parts) for parts in zip(*map(topk_values, ORDER), strict=True))
    assert torch.equal(signal.ids, torch.from_numpy(ids).long())
    assert torch.equal(signal.logprobs, torch.from_numpy(logprobs).float())
    assert signal.next_logprobs is not None
    assert torch.equal(signal.next_logprobs, torch.from_numpy(following).float())
    first = CacheTeacher(STORED / "topk", top_k=1).topk(data, supervised_positions(data["labels"]))
    assert torch.equal(first.ids, signal.ids[:, :1])


@pytest.mark.parametrize("name", ["hidden_fp16", "hidden_bf16"])
def test_a_stored_hidden_cache_reads_its_states_and_head(name):
    hidden_dtype = CACHES[name][1]
    cache = open_teacher_cache(STORED / name)
    assert isinstance(cache, HiddenCacheTeacher) and cache.hidden_dtype == hidden_dtype
    data = batch(ORDER)
    states, got_head = cache.hidden_states(data, supervised_positions(data["labels"]))
    want = torch.cat([hidden_values(row, hidden_dtype) for row in ORDER])
    rounded = want.to(torch.bfloat16 if hidden_dtype == "bfloat16" else torch.float16).float()
    assert torch.equal(states, rounded)
    expected = head(hidden_dtype)
    assert torch.equal(got_head.weight, expected.weight)
    assert (got_head.scale, got_head.softcap) == (expected.scale, expected.softcap)
    assert (got_head.bias is None) == (expected.bias is None)
    if expected.bias is not None:
        assert torch.equal(got_head.bias, expected.bias)


def test_todays_writers_write_the_stored_bytes(tmp_path):
    write_stored_caches(tmp_path)
    stored = sorted(path.relative_to(STORED) for path in STORED.rglob("*") if path.is_file())
    written = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file())
    assert written == stored
    for relative in stored:
        assert (tmp_path / relative).read_bytes() == (STORED / relative).read_bytes(), relative


if __name__ == "__main__":  # regenerate stored/ (see the module docstring first)
    import shutil

    shutil.rmtree(STORED, ignore_errors=True)
    write_stored_caches(STORED)
    print(f"wrote {sorted(str(p.relative_to(STORED)) for p in STORED.rglob('*') if p.is_file())}", file=sys.stderr)
