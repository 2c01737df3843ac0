"""Reusing a decode's KV cache across the turns of a multi-turn rollout: pure functions, tensors in and out.

A multi-turn rollout samples each turn from every row's whole transcript so far (prompt, earlier turns, the
environment's replies), left-padded. The keys and values of a row's transcript up to the end of its last turn were
computed by the previous turn's decode; these functions carry them into the next decode, which then prefills only
each row's new suffix (the reply and the next generation prompt):

* ``kept_kv``: after a decode, the columns of its cache that hold tokens the model consumed (the context and each
  row's sampled tokens up to and including its EOS, as far as they were fed: the last sampled token never is), and
  those tokens, per row: a ``KeptKV``.
* ``match_rows``: for each new row, the kept row whose tokens start it, and how many of its tokens to reuse.
* ``gather_kv``: the reused keys and values of the new rows, re-padded to the new batch: a ``PastKV``.
* ``suffix_inputs``: the new rows' tokens after their reused ones, left-padded.

Layout of a prefill on reused KV (row ``b`` reuses ``K_b`` tokens and feeds ``S_b`` more; ``C = max K_b``,
``S = max S_b``)::

    cache columns [0, C):      padding (mask 0), then row b's K_b reused columns (mask 1), right-aligned
    input columns [C, C + S):  padding (mask 0), then row b's S_b suffix tokens (mask 1), right-aligned

Position ids count each row's real tokens over the whole mask (``position_ids_from_mask``), so row ``b``'s suffix
starts at position ``K_b``, as in a prefill of its whole transcript. The masked columns between a row's reused
columns and its suffix get attention weight 0, so the decode equals one that re-prefills the transcript, up to
floating-point summation order. A sliding-window attention counts columns, not tokens, and would see those columns:
a decode may reuse KV only while its whole width stays inside every layer's window (``KeptKV.window``).

Shapes: ``B`` kept rows, ``R`` new rows, ``L`` layers, ``H`` key/value heads, ``W`` kept cache columns, ``D`` head
size, ``P`` new prompt width, ``N`` sampled tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "KeptKV",
    "PastKV",
    "consumed_lengths",
    "gather_kv",
    "is_left_padded",
    "kept_kv",
    "match_rows",
    "row_tokens",
    "suffix_inputs",
    "weights_fingerprint",
]


@dataclass
class PastKV:
    """Keys and values a prefill starts from: per layer ``(R, H, C, D)`` tensors, and the ``(R, C)`` long mask of
    the columns that hold tokens (1) or padding (0). Row ``r``'s real columns are contiguous and right-aligned."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


@dataclass
class KeptKV:
    """A finished decode's cache, kept for the next turn: per layer ``(B, H, W, D)`` keys and values; ``columns``
    ``(B, W)`` bool, the columns that hold a token row ``b`` consumed; ``tokens``, those tokens per row, in column
    order (``len(tokens[b]) == columns[b].sum()``); ``window``, the smallest sliding window of the cache's layers
    (None: full attention everywhere)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    columns: torch.Tensor
    tokens: list[list[int]]
    window: int | None = None

    def nbytes(self) -> int:
        """Bytes the kept keys and values hold."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def is_left_padded(mask: torch.Tensor) -> bool:
    """Whether every row of ``mask`` ``(R, P)`` is padding (0) then tokens (1), with no hole."""
    mask = mask.long()
    width = mask.shape[1]
    lengths = mask.sum(dim=1, keepdim=True)
    expected = torch.arange(width, device=mask.device)[None, :] >= width - lengths
    return bool(torch.equal(mask.bool(), expected))


def row_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens of ``ids`` ``(R, P)`` (where ``mask`` ``(R, P)`` is 1), in order: one host read."""
    flat, keep = ids.tolist(), mask.bool().tolist()
    return [[t for t, k in zip(row, kept, strict=True) if k] for row, kept in zip(flat, keep, strict=True)]


def consumed_lengths(lengths: torch.Tensor, fed: int) -> torch.Tensor:
    """``(B,)`` how many of each row's sampled tokens the model consumed: its completion length (``(B,)`` long, up to
    and including its EOS) capped at ``fed``, the decode steps that fed a token (a decode of ``N`` tokens feeds the
    first ``N - 1``; the last one sampled is never fed)."""
    return lengths.clamp(max=fed)


def kept_kv(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    context_mask: torch.Tensor,
    context_tokens: Sequence[Sequence[int]],
    completion_ids: torch.Tensor,
    completion_lengths: torch.Tensor,
    fed: int,
    *,
    window: int | None = None,
) -> KeptKV:
    """What a finished decode leaves for the next turn.

    Args:
        keys, values: per layer ``(B, H, W, D)``, ``W = Wc + fed``: the cache after the decode.
        context_mask: ``(B, Wc)`` the mask of the cache's columns before the first decode step (the prefill's
            columns, reused ones included): 1 on the row's context tokens.
        context_tokens: each row's context tokens, in order (``context_mask[b].sum()`` of them).
        completion_ids: ``(B, N)`` the sampled tokens.
        completion_lengths: ``(B,)`` each row's completion length (``completion_lengths``: up to and including
            its first EOS; ``N`` without one).
        fed: how many decode steps fed a token (the cache holds them after the context columns).
        window: the smallest sliding window among the cache's layers (None: none).

    Returns:
        ``KeptKV`` whose columns are the context's and the first ``min(length, fed)`` decode columns of each row,
        and whose tokens are the context tokens followed by those sampled tokens.

    Raises:
        ValueError: when the cache's width is not ``Wc + fed`` (a layer that drops columns) or a row's context tokens
            do not number its context columns.
    """
    batch, context_width = context_mask.shape
    width = context_width + fed
    for tensor in (*keys, *values):
        if tensor.shape[0] != batch or tensor.shape[2] != width:
            raise ValueError(
                f"a kept cache layer has shape {tuple(tensor.shape)}, expected {batch} rows and {width} columns "
                f"({context_width} context + {fed} decoded): the cache dropped or added columns"
            )
    consumed = consumed_lengths(completion_lengths.to(context_mask.device), fed)
    steps = torch.arange(fed, device=context_mask.device)[None, :]
    columns = torch.cat([context_mask.bool(), steps < consumed[:, None]], dim=1)
    sampled = completion_ids.tolist()
    counts = consumed.tolist()
    tokens = []
    for b, context in enumerate(context_tokens):
        if len(context) != int(context_mask[b].sum()):
            raise ValueError(f"row {b} has {len(context)} context tokens but {int(context_mask[b].sum())} columns")
        tokens.append([*context, *sampled[b][: counts[b]]])
    return KeptKV(list(keys), list(values), columns, tokens, window)


def match_rows(
    kept_tokens: Sequence[Sequence[int]], new_tokens: Sequence[Sequence[int]]
) -> tuple[list[int], list[int]]:
    """For each new row, the kept row whose tokens are a prefix of its tokens (the longest such; -1: none) and how
    many tokens it reuses: that kept row's length, at most the new row's length less one (a prefill feeds at least
    one token, whose logits start the decode); 0 without a match. Several new rows may reuse one kept row."""
    by_tokens: dict[tuple[int, ...], int] = {}
    for index, tokens in enumerate(kept_tokens):
        if tokens:
            by_tokens.setdefault(tuple(tokens), index)
    lengths = sorted({len(t) for t in by_tokens}, reverse=True)
    sources, reuse = [], []
    for tokens in new_tokens:
        found = -1
        for length in lengths:
            if length <= len(tokens):
                found = by_tokens.get(tuple(tokens[:length]), -1)
                if found >= 0:
                    break
        count = min(len(kept_tokens[found]), len(tokens) - 1) if found >= 0 else 0
        sources.append(found if count > 0 else -1)
        reuse.append(max(count, 0))
    return sources, reuse


def gather_kv(kept: KeptKV, sources: torch.Tensor, reuse: torch.Tensor) -> PastKV:
    """The reused keys and values of the new rows, re-padded to the new batch.

    Args:
        kept: the previous decode's ``KeptKV`` (``B`` rows).
        sources: ``(R,)`` long, the kept row each new row reuses (-1: none).
        reuse: ``(R,)`` long, how many of that row's consumed tokens it reuses (0 with no source; at most the kept
            row's token count).

    Returns:
        ``PastKV`` of width ``C = max(reuse)``: new row ``r``'s first ``reuse[r]`` consumed columns of kept row
        ``sources[r]``, in order, right-aligned; the columns to their left are zeros, masked 0.
    """
    device = kept.columns.device
    sources, reuse = sources.to(device), reuse.to(device)
    width = int(reuse.max()) if reuse.numel() else 0
    # each kept row's consumed columns first, in column order
    order = torch.argsort((~kept.columns).to(torch.int8), dim=1, stable=True)
    rank = torch.arange(width, device=device)[None, :] - (width - reuse[:, None])  # (R, C)
    valid = (rank >= 0) & (sources[:, None] >= 0)
    rows = sources.clamp(min=0)
    columns = order[rows].gather(1, rank.clamp(min=0))  # (R, C): the kept column behind each new one
    index = (rows[:, None], slice(None), columns)

    def take(tensor: torch.Tensor) -> torch.Tensor:
        picked = tensor[index].permute(0, 2, 1, 3)  # (R, C, H, D) -> (R, H, C, D)
        return torch.where(valid[:, None, :, None], picked, torch.zeros((), dtype=picked.dtype, device=device))

    return PastKV([take(k) for k in kept.keys], [take(v) for v in kept.values], valid.long())


def suffix_inputs(ids: torch.Tensor, mask: torch.Tensor, reuse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new rows' tokens after the ones they reuse, left-padded.

    Args:
        ids: ``(R, P)`` left-padded rows (``is_left_padded(mask)``).
        mask: ``(R, P)`` 1 on real tokens.
        reuse: ``(R,)`` how many of each row's first real tokens its reused KV covers (fewer than its tokens).

    Returns:
        ``(R, S)`` ids and ``(R, S)`` long mask, ``S = max(T_r - reuse_r)`` (``T_r``: row ``r``'s real tokens):
        row ``r``'s last ``T_r - reuse_r`` tokens, right-aligned, masked 1; the columns to their left masked 0.
    """
    width = ids.shape[1]
    lengths = mask.long().sum(dim=1)
    suffix = lengths - reuse.to(lengths.device)
    if bool((suffix < 1).any()):
        raise ValueError("every row must keep at least one token to prefill after its reused ones")
    span = int(suffix.max())
    columns = torch.arange(span, device=ids.device)[None, :]
    return ids[:, width - span :], (columns >= span - suffix[:, None]).long()


def weights_fingerprint(model: torch.nn.Module) -> tuple[int, int]:
    """A cheap fingerprint of ``model``'s weights: the sum of its parameters' version counters (every in-place
    write through autograd-visible tensors bumps one: optimizer steps, ``copy_``, ``load_state_dict``) and a hash
    of their storage addresses (a parameter replaced). Writes through ``.data`` bump no counter: announce those
    with the sampler's ``weights_updated``. Inference tensors (made under ``torch.inference_mode``) track no
    version: a model with any gets a fingerprint that equals no other, so nothing kept is reused for it."""
    parameters = list(model.parameters())
    if any(p.is_inference() for p in parameters):
        return -1, next(_UNTRACKED)
    return sum(p._version for p in parameters), hash(tuple(p.data_ptr() for p in parameters))


_UNTRACKED = itertools.count()
