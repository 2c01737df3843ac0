"""Projecting a teacher's distributions onto a student's vocabulary (cross-tokenizer distillation,
``cross_tokenizer.loss=projected``): which student token each teacher token's text starts with, each teacher token's
bytes, and the teacher tokens that extend each prefix, as the flat tensors of ``ops.chunk_likelihood.ProjectionTables``
(``projection_plan`` reads them). Built once per tokenizer pair, optionally cached on disk keyed by both tokenizers'
fingerprints."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.retokenize import _TokenBytes
from lightning_gkd.data.tokenizer import tokenizer_fingerprint
from lightning_gkd.ops.cross_tokenizer.chunk_likelihood import ProjectionTables

__all__ = ["ProjectionTables", "projection_cache_path", "projection_tables"]

#: Bumped when the tables' construction changes, so older cache files are not read.
_TABLES_VERSION = 1


def _teacher_token_bytes(teacher_tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """Each teacher token's bytes; None for special (added) tokens."""
    teacher_bytes = _TokenBytes(teacher_tokenizer)
    ids = list(range(len(teacher_tokenizer)))
    pieces = teacher_bytes._mapped(ids)  # one call for the whole vocabulary where every token maps
    out: list[bytes | None] = []
    for index in ids:
        if index in teacher_bytes.added:
            out.append(None)
            continue
        if pieces is None:
            mapped = teacher_bytes._mapped([index])
            out.append(mapped[0] if mapped is not None else teacher_bytes.text([index]).encode())
        else:
            out.append(pieces[index])
    return out


def _first_student_tokens(student_tokenizer: PreTrainedTokenizerBase, texts: Sequence[bytes]) -> list[int]:
    """The first student token of each byte string tokenized alone: -1 when it is not whole UTF-8 characters or
    tokenizes to nothing."""
    decoded: dict[int, str] = {}
    for index, raw in enumerate(texts):
        try:
            decoded[index] = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
    out = [-1] * len(texts)
    order = list(decoded)
    strings = [decoded[i] for i in order]
    backend = getattr(student_tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):  # what __call__ runs, without its wrapping
        encoded: list[list[int]] = [e.ids for e in backend.encode_batch_fast(strings, add_special_tokens=False)]
    else:
        encoded = student_tokenizer(strings, add_special_tokens=False)["input_ids"] if order else []
    for index, ids in zip(order, encoded, strict=True):
        if ids:
            out[index] = ids[0]
    return out


def _build(student_tokenizer: PreTrainedTokenizerBase, teacher_tokenizer: PreTrainedTokenizerBase) -> ProjectionTables:
    student_vocab = student_tokenizer.get_vocab()
    token_bytes = _teacher_token_bytes(teacher_tokenizer)
    added = {index: token.content for index, token in teacher_tokenizer.added_tokens_decoder.items()}
    plain = {index: raw for index, raw in enumerate(token_bytes) if raw is not None}
    first = torch.full((len(token_bytes),), -1, dtype=torch.long)
    targets = _first_student_tokens(student_tokenizer, list(plain.values()))
    first[list(plain)] = torch.tensor(targets, dtype=torch.long)
    for index, content in added.items():
        if index < len(token_bytes) and content in student_vocab:
            first[index] = student_vocab[content]
    teacher_eos, student_eos = teacher_tokenizer.eos_token_id, student_tokenizer.eos_token_id
    if teacher_eos is not None and student_eos is not None and int(first[teacher_eos]) < 0:
        first[teacher_eos] = student_eos
    suffixes = list({raw[cut:] for raw in plain.values() for cut in range(1, len(raw))})
    suffix_target = dict(zip(suffixes, _first_student_tokens(student_tokenizer, suffixes), strict=True))
    grouped: dict[bytes, tuple[list[int], list[int]]] = {}
    for index, raw in plain.items():
        for cut in range(1, len(raw)):
            target = suffix_target[raw[cut:]]
            if target >= 0:
                extending, their_targets = grouped.setdefault(raw[:cut], ([], []))
                extending.append(index)
                their_targets.append(target)
    return ProjectionTables.from_parts(first, token_bytes, grouped)


def projection_cache_path(
    student_tokenizer: PreTrainedTokenizerBase, teacher_tokenizer: PreTrainedTokenizerBase, cache_dir: str | Path
) -> Path:
    """Where the tables of this tokenizer pair are cached in ``cache_dir``: a file named by a hash of both tokenizers'
    fingerprints (``data.tokenizer.tokenizer_fingerprint``: vocabulary, special tokens, chat template) and the tables'
    version."""
    key = f"{tokenizer_fingerprint(student_tokenizer)}:{tokenizer_fingerprint(teacher_tokenizer)}:{_TABLES_VERSION}"
    return Path(cache_dir).expanduser() / f"projection-{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}.pt"


def projection_tables(
    student_tokenizer: PreTrainedTokenizerBase,
    teacher_tokenizer: PreTrainedTokenizerBase,
    cache_dir: str | Path | None = None,
) -> ProjectionTables:
    """Build the ``ProjectionTables`` of a student/teacher tokenizer pair (once per run: one student tokenization
    per teacher token and per distinct proper suffix of one).

    ``first_token``: a special (added) token maps to the student token of the same string (the teacher's EOS to the
    student's EOS otherwise); any other token to the first id of the student's tokenization of its text alone.
    Tokens whose bytes are not whole UTF-8 characters (a byte-level piece of a character), or whose text the student
    tokenizes to nothing, map to -1. Exact for a byte-level student; for others the text's first student token can
    differ in context (a merge across the teacher token's start), which this ignores.

    ``cache_dir``: read the tables from there when this pair was built before (``projection_cache_path``), else
    build and write them there (a 152k-token pair takes seconds to build; loading is a fraction of that).
    """
    if cache_dir is None:
        return _build(student_tokenizer, teacher_tokenizer)
    path = projection_cache_path(student_tokenizer, teacher_tokenizer, cache_dir)
    if path.is_file():
        stored = torch.load(path, map_location="cpu", weights_only=True)
        return ProjectionTables(**{f.name: stored[f.name] for f in fields(ProjectionTables)})
    tables = _build(student_tokenizer, teacher_tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({f.name: getattr(tables, f.name) for f in fields(ProjectionTables)}, partial)
    partial.replace(path)  # atomic: a concurrent reader sees the whole file or none
    return tables
