"""Reading a teacher cache (``teachers.offline.format``) as a teacher: ``CacheTeacher`` (top-k: a ``SparseTeacher``),
``HiddenCacheTeacher`` (final hidden states and the head: an exact dense ``Teacher``), ``open_teacher_cache`` (the
one its manifest names). Each checks the cache complete, the student's tokenizer and the data against the manifest,
and finds each batch row by the key of its token ids."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.rows import fit_rows
from lightning_gkd.data.tokenizer import tokenizer_fingerprint
from lightning_gkd.teachers.base import TeacherBase, TopKSignal
from lightning_gkd.teachers.hidden import HiddenStateTeacher
from lightning_gkd.teachers.offline.fingerprints import data_fingerprint, row_keys
from lightning_gkd.teachers.offline.format import BUILD_COMMAND, decode_hidden, manifest_signal
from lightning_gkd.teachers.offline.head import read_head
from lightning_gkd.teachers.offline.manifest import load_complete_manifest, rebuild_hint
from lightning_gkd.teachers.offline.shards import flat_values, read_shards


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
                "(lightning_gkd.teachers.offline.reader.open_teacher_cache picks the reader from the manifest)."
            )
        self._records: Any = None  # the concatenated Dataset (holds the memory maps)
        self._index: dict[str, int] = {}
        self._counts: np.ndarray = np.zeros(0, dtype=np.int64)

    def _table(self) -> pa.Table:
        if self._records is None:
            self._records = read_shards([self.path / shard["name"] for shard in self.manifest["shards"]])
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
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise self._built_for_other(
                f"was built with a tokenizer of fingerprint {self.manifest['tokenizer_fingerprint']}, but the "
                f"student's tokenizer ({name}) has {fingerprint}: its token ids mean other tokens. Use the tokenizer "
                "the cache was built with, or rebuild the cache"
            )

    def check_datamodule(self, datamodule: Any) -> None:
        """The data must be what the cache was built over: ``max_length`` and the fingerprint of the training then
        validation rows (``lightning_gkd.data.rows.fit_rows``), each row's last assistant turn."""
        refuse_every_assistant_turn(datamodule)
        max_length = getattr(datamodule, "max_length", None)
        if max_length != self.manifest["max_length"]:
            raise self._built_for_other(
                f"was built with max_length={self.manifest['max_length']}, the data has max_length={max_length} "
                "(data.max_length): rebuild the cache for it"
            )
        rows = fit_rows(datamodule)
        fingerprint = data_fingerprint(rows)
        if fingerprint != self.manifest["data_fingerprint"]:
            raise self._built_for_other(
                f"was built over {self.manifest['num_rows']} rows (training, then validation) of fingerprint "
                f"{self.manifest['data_fingerprint']}; the data has {len(rows)} rows of fingerprint {fingerprint}. "
                "Rebuild the cache over this data"
            )

    def _built_for_other(self, difference: str) -> ValueError:
        """The error for a run the cache was not built for: "The teacher cache at <path> <difference>: <the command
        that builds one for it>."."""
        return ValueError(f"The teacher cache at {self.path} {difference}: {rebuild_hint(self.manifest)}.")


class CacheTeacher(CacheReader):
    """A ``SparseTeacher`` that reads a top-k cache written by ``lightning_gkd.teachers.offline.build``.

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
        ids = flat_values(taken, "topk_ids", 2).reshape(n, self.k)[:, : self.top_k]
        logprobs = flat_values(taken, "topk_logprobs", 2).reshape(n, self.k)[:, : self.top_k]
        following = flat_values(taken, "next_logprobs", 1)
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
    ``lightning_gkd.teachers.offline.build``: the teacher's final hidden states at each batch row's supervised
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
        return decode_hidden(flat_values(taken, "hidden", 2).reshape(n, self.hidden_size), self.hidden_dtype)

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


def refuse_every_assistant_turn(datamodule: Any) -> None:
    """A cache holds the teacher's signal on each row's last assistant turn (what validation scores too); training on
    every turn (``data.assistant_turns=all``) would find no teacher signal at the earlier turns."""
    if getattr(datamodule, "assistant_turns", "last") != "last":
        raise ValueError(
            "teacher=cache holds the teacher's signal on each row's last assistant turn, but data.assistant_turns="
            f"{datamodule.assistant_turns!r} trains on every assistant turn. Use data.assistant_turns=last with the "
            "cache, or a teacher that scores any position (teacher=local or teacher=server)."
        )
