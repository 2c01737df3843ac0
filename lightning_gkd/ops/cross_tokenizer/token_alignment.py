"""Aligning two tokenizations of one text by UTF-8 byte spans, and merging a group of tokens' probabilities into one
distribution: the first two steps of the cross-tokenizer loss (``lightning_gkd.ops.cross_tokenizer.aligned_row_loss``).

A span is a token's ``(start, end)`` in bytes from the start of the completion's content; end tokens (the EOS and
anything after it) are zero-width at ``(content_len, content_len)``. ``probs[k]`` is a model's distribution *for*
token ``k`` (the usual shift). Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "MERGE_STRATEGIES",
    "align_byte_spans",
    "align_flat_spans",
    "end_token_count",
    "merge_group_probs",
    "token_id_list",
]

MERGE_STRATEGIES = ("observed", "bayesian")
# TRL's floor for probabilities before a log (merged scalars).
EPS = 1e-8

Span = Sequence[int]
Groups = list[list[int]]

# --------------------------------------------------------------------------- alignment


def _check_spans(spans: Sequence[Span], side: str) -> None:
    previous_end = 0
    for k, span in enumerate(spans):
        if len(span) != 2:
            raise ValueError(f"{side}_spans[{k}] = {tuple(span)!r} is not a (start, end) byte pair.")
        start, end = int(span[0]), int(span[1])
        if not 0 <= start <= end:
            raise ValueError(
                f"{side}_spans[{k}] = ({start}, {end}): a byte span needs 0 <= start <= end. Spans are UTF-8 byte "
                "offsets relative to the start of the completion's content."
            )
        if end < previous_end:
            raise ValueError(
                f"{side}_spans[{k}] ends at byte {end}, before the previous token's end {previous_end}: spans must "
                "follow the tokens in order (end tokens zero-width at the content's end)."
            )
        previous_end = end


def align_byte_spans(
    student_spans: Sequence[Span], teacher_spans: Sequence[Span]
) -> tuple[list[list[int]], list[list[int]]]:
    """Group two tokenizations of the same text at the byte boundaries they share.

    Walks both span lists at once, each step advancing the side whose current token ends at the earlier byte (both
    when they end at the same byte, which closes a group). A group is a run of consecutive token indices; the two
    lists have one entry per group, in order. One student token covering two teacher tokens gives ``[i]`` /
    ``[j, j + 1]``; interleaved splits (student ``[0,2), [2,4)``, teacher ``[0,1), [1,4)``) give one group of two on
    each side. Zero-width end tokens at the same end byte pair up one to one. Tokens left on one side after the
    other is exhausted (or when the two never meet again) form one last group, whose other side may be empty.

    Args:
        student_spans: ``N_s`` byte spans ``(start, end)`` of the student's completion tokens, in token order.
        teacher_spans: ``N_t`` byte spans of the teacher's completion tokens.

    Returns:
        ``(student_groups, teacher_groups)``: two lists of ``G`` lists of token indices; every index of each side
        appears once, in order.

    Raises:
        ValueError: a span that is not ``(start, end)`` with ``0 <= start <= end``, or ends that go backwards.
    """
    _check_spans(student_spans, "student")
    _check_spans(teacher_spans, "teacher")
    n_s, n_t = len(student_spans), len(teacher_spans)
    student_groups: Groups = []
    teacher_groups: Groups = []
    s = t = s_open = t_open = 0
    while s < n_s and t < n_t:
        s_end, t_end = int(student_spans[s][1]), int(teacher_spans[t][1])
        if s_end <= t_end:
            s += 1
        if t_end <= s_end:
            t += 1
        if s_end == t_end:
            student_groups.append(list(range(s_open, s)))
            teacher_groups.append(list(range(t_open, t)))
            s_open, t_open = s, t
    if s_open < n_s or t_open < n_t:
        student_groups.append(list(range(s_open, n_s)))
        teacher_groups.append(list(range(t_open, n_t)))
    return student_groups, teacher_groups


def align_flat_spans(
    student_ends: torch.Tensor, student_rows: torch.Tensor, teacher_ends: torch.Tensor, teacher_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``align_byte_spans`` for a batch at once, vectorised over tokens: the rows' tokens flat, row after row.

    Two tokens close a group when they are the ``r``-th token of their side to end at the same byte of the same row
    (the walk pairs equal ends one to one, in order); the tokens after a row's last closing form one last group,
    kept only when both sides have tokens in it (``align_byte_spans``'s pairs with an empty side are dropped).

    Args:
        student_ends, teacher_ends: ``[N_s]`` / ``[N_t]`` int64 end bytes, non-decreasing within a row.
        student_rows, teacher_rows: each token's row, non-decreasing.

    Returns:
        ``(student_group, teacher_group, G)``: each token's group (``0 <= g < G``, groups in row order then byte
        order; -1 for a token of a dropped group) and the number of groups.
    """
    device = student_ends.device

    def keys(ends: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        index = torch.arange(ends.numel(), device=device)
        new_run = torch.ones_like(ends, dtype=torch.bool)
        new_run[1:] = (ends[1:] != ends[:-1]) | (rows[1:] != rows[:-1])
        rank = index - torch.cummax(torch.where(new_run, index, 0), 0).values
        return (rows << 44) | (ends << 20) | rank

    s_key, t_key = keys(student_ends, student_rows), keys(teacher_ends, teacher_rows)

    def closes(key: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if other.numel() == 0:
            return torch.zeros_like(key, dtype=torch.bool)
        found = torch.searchsorted(other, key).clamp(max=other.numel() - 1)
        return other[found] == key

    s_close, t_close = closes(s_key, t_key), closes(t_key, s_key)
    # group slot: closings before the token (over the batch) plus one trailing slot per earlier row
    s_slot = torch.cumsum(s_close, 0) - s_close.long() + student_rows
    t_slot = torch.cumsum(t_close, 0) - t_close.long() + teacher_rows
    rows = int(
        max(
            int(student_rows.max()) + 1 if student_rows.numel() else 0,
            int(teacher_rows.max()) + 1 if teacher_rows.numel() else 0,
        )
    )
    slots = int(s_close.sum()) + rows
    both = (torch.bincount(s_slot, minlength=slots)[:slots] > 0) & (torch.bincount(t_slot, minlength=slots)[:slots] > 0)
    number = torch.cumsum(both, 0) - 1
    s_group = torch.where(both[s_slot], number[s_slot], -1) if s_slot.numel() else s_slot
    t_group = torch.where(both[t_slot], number[t_slot], -1) if t_slot.numel() else t_slot
    return s_group, t_group, int(both.sum())


def end_token_count(spans: Sequence[Span]) -> int:
    """The number of trailing end tokens: the last tokens whose spans are zero-width at the content's end (the largest
    end byte). A completion without an EOS (a sample cut at ``max_new_tokens``) has none; an empty content (only end
    tokens) has ``len(spans)``."""
    if not spans:
        return 0
    content_len = max(int(span[1]) for span in spans)
    count = 0
    for span in reversed(spans):
        if int(span[0]) != content_len or int(span[1]) != content_len:
            break
        count += 1
    return count


# --------------------------------------------------------------------------- merging


def token_id_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return [int(i) for i in token_ids.reshape(-1).tolist()]
    return [int(i) for i in token_ids]


def merge_group_probs(
    probs: torch.Tensor,
    groups: Sequence[Sequence[int]],
    token_ids: Sequence[int] | torch.Tensor,
    strategy: Literal["observed", "bayesian"],
) -> torch.Tensor:
    r"""One distribution per aligned group: the distribution at one position times the probabilities of the group's
    other actual tokens (the chain rule; unnormalised, as TRL).

    For a group of positions ``g = [i, ..., j]`` with actual tokens ``x_i, ..., x_j``:

    - ``"observed"``: :math:`P_g = p_i \prod_{k \in g, k > i} \max(p_k[x_k], 10^{-8})` — the distribution of the
      group's first token, weighted by how likely the model found the rest of the group.
    - ``"bayesian"``: :math:`P_g = p_j \prod_{k \in g, k < j} \max(p_k[x_k], 10^{-8})` — the distribution of the
      last token given the actual prefix, times the prefix's probability.

    A one-token group is its row unchanged; an empty group is a row of zeros.

    Args:
        probs: ``[N, V]`` probabilities; ``probs[k]`` is the distribution for token ``k``.
        groups: ``G`` lists of indices into ``probs`` (from ``align_byte_spans``).
        token_ids: the ``N`` actual token ids.
        strategy: ``"observed"`` or ``"bayesian"``.

    Returns:
        ``[G, V]`` merged rows, in ``probs``'s dtype, differentiable with respect to ``probs``.

    Raises:
        ValueError: an unknown strategy, ``token_ids`` of another length than ``N``, an index outside ``[0, N)`` or a
            token id outside ``[0, V)``.
    """
    if strategy not in MERGE_STRATEGIES:
        raise ValueError(f"merge strategy must be one of {MERGE_STRATEGIES}, got {strategy!r}.")
    if probs.dim() != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}.")
    n, vocab = probs.shape
    ids = token_id_list(token_ids)
    if len(ids) != n:
        raise ValueError(f"token_ids has {len(ids)} ids for {n} rows of probs; pass one id per row.")
    base_rows: list[int] = []
    scalar_rows: list[int] = []
    scalar_groups: list[int] = []
    empty: list[int] = []
    for g, group in enumerate(groups):
        positions = [int(k) for k in group]
        for k in positions:
            if not 0 <= k < n:
                raise ValueError(f"groups[{g}] holds position {k}, outside the {n} rows of probs.")
        if not positions:
            base_rows.append(0)
            empty.append(g)
            continue
        if strategy == "observed":
            base, rest = positions[0], positions[1:]
        else:
            base, rest = positions[-1], positions[:-1]
        base_rows.append(base)
        for k in rest:
            if not 0 <= ids[k] < vocab:
                raise ValueError(
                    f"token_ids[{k}] = {ids[k]} is outside the vocabulary of probs (size {vocab}): the ids must come "
                    "from the tokenizer of the model that gave these probabilities."
                )
            scalar_rows.append(k)
            scalar_groups.append(g)
    if n == 0:  # every group is empty
        return probs.new_zeros((len(base_rows), vocab))
    device = probs.device
    merged = probs[torch.tensor(base_rows, dtype=torch.long, device=device)]
    if scalar_rows:
        rows = torch.tensor(scalar_rows, dtype=torch.long, device=device)
        picked = probs[rows, torch.tensor([ids[k] for k in scalar_rows], dtype=torch.long, device=device)]
        log_factor = probs.new_zeros(len(base_rows)).index_add(
            0, torch.tensor(scalar_groups, dtype=torch.long, device=device), picked.clamp_min(EPS).log()
        )
        merged = merged * log_factor.exp().unsqueeze(-1)
    if empty:
        keep = torch.ones(len(base_rows), dtype=probs.dtype, device=device)
        keep[torch.tensor(empty, dtype=torch.long, device=device)] = 0
        merged = merged * keep.unsqueeze(-1)
    return merged
