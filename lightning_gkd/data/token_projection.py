"""Projecting a teacher's distributions onto a student's vocabulary (cross-tokenizer distillation,
``cross_tokenizer.loss=projected``): which student token each teacher token's text starts with, each teacher token's
bytes, and the teacher tokens that extend each prefix (``ops.chunk_likelihood.projected_teacher_targets`` reads
them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.retokenize import _TokenBytes

__all__ = ["ProjectionTables", "projection_tables"]


def _teacher_token_bytes(teacher_tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """Each teacher token's bytes; None for special (added) tokens."""
    teacher_bytes = _TokenBytes(teacher_tokenizer)
    out: list[bytes | None] = []
    for index in range(len(teacher_tokenizer)):
        if index in teacher_bytes.added:
            out.append(None)
            continue
        pieces = teacher_bytes._mapped([index])
        out.append(pieces[0] if pieces is not None else teacher_bytes.text([index]).encode())
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
    encoded = student_tokenizer([decoded[i] for i in order], add_special_tokens=False)["input_ids"] if order else []
    for index, ids in zip(order, encoded, strict=True):
        if ids:
            out[index] = ids[0]
    return out


@dataclass(frozen=True)
class ProjectionTables:
    """What projecting the teacher's distributions onto the student's vocabulary needs (``projection_tables``).

    Attributes:
        first_token: ``[V_T]`` int64: for each teacher token, the student token its text starts with (-1: none).
            A special (added) token maps to the student token of the same string (the teacher's EOS to the
            student's EOS otherwise); any other token to the first id of the student's tokenization of its text
            alone. Tokens whose bytes are not whole UTF-8 characters (a byte-level piece of a character), or whose
            text the student tokenizes to nothing, map to -1. Exact for a byte-level student; for others the text's
            first student token can differ in context (a merge across the teacher token's start), which this
            ignores.
        token_bytes: each teacher token's bytes, None for special tokens.
        extensions: for every proper prefix ``P`` of a teacher token's bytes, the teacher tokens that extend it
            (``ids``, int64) and the student token each one's remaining bytes start with (``targets``, int64;
            tokens whose remainder maps to none are left out).
    """

    first_token: torch.Tensor
    token_bytes: list[bytes | None]
    extensions: dict[bytes, tuple[torch.Tensor, torch.Tensor]]


def projection_tables(
    student_tokenizer: PreTrainedTokenizerBase, teacher_tokenizer: PreTrainedTokenizerBase
) -> ProjectionTables:
    """Build the ``ProjectionTables`` of a student/teacher tokenizer pair (once per run: one student tokenization
    per teacher token and per proper suffix of one)."""
    student_vocab = student_tokenizer.get_vocab()
    token_bytes = _teacher_token_bytes(teacher_tokenizer)
    added = {index: token.content for index, token in teacher_tokenizer.added_tokens_decoder.items()}
    plain = {index: raw for index, raw in enumerate(token_bytes) if raw is not None}
    first = torch.full((len(token_bytes),), -1, dtype=torch.long)
    targets = _first_student_tokens(student_tokenizer, list(plain.values()))
    for index, target in zip(plain, targets, strict=True):
        first[index] = target
    for index, content in added.items():
        if index < len(token_bytes) and content in student_vocab:
            first[index] = student_vocab[content]
    teacher_eos, student_eos = teacher_tokenizer.eos_token_id, student_tokenizer.eos_token_id
    if teacher_eos is not None and student_eos is not None and int(first[teacher_eos]) < 0:
        first[teacher_eos] = student_eos
    entries = [(raw[:cut], index, raw[cut:]) for index, raw in plain.items() for cut in range(1, len(raw))]
    suffixes = sorted({suffix for _, _, suffix in entries})
    suffix_target = dict(zip(suffixes, _first_student_tokens(student_tokenizer, suffixes), strict=True))
    grouped: dict[bytes, tuple[list[int], list[int]]] = {}
    for prefix, index, suffix in entries:
        if suffix_target[suffix] >= 0:
            extending, their_targets = grouped.setdefault(prefix, ([], []))
            extending.append(index)
            their_targets.append(suffix_target[suffix])
    table = {prefix: (torch.tensor(ids), torch.tensor(cols)) for prefix, (ids, cols) in grouped.items()}
    return ProjectionTables(first, token_bytes, table)
