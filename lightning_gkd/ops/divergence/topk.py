"""A model's top-k next-token log-probs from its final hidden states, a chunk of positions at a time.

What a sparse teacher signal is made of (``lightning_gkd.teachers.TopKSignal``): the in-process teacher and the
offline cache builder compute it here; a vLLM server computes the same numbers with ``prompt_logprobs``.
"""

from __future__ import annotations

import torch

from lightning_gkd.ops.hf.heads import LogitHead

__all__ = ["topk_log_probs"]


@torch.no_grad()
def topk_log_probs(
    hidden: torch.Tensor,
    head: LogitHead,
    k: int,
    *,
    next_tokens: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``k`` most likely next tokens and their log-probs, ``log_softmax(head.logits(hidden))`` at temperature 1.

    Args:
        hidden: ``(N, H)`` final hidden states.
        head: the model's ``LogitHead`` (``(V, H)`` weight).
        k: how many tokens per position, ``1 <= k <= V``.
        next_tokens: ``(N,)`` the token that actually follows each position (the label), or None.
        chunk_size: positions projected to logits at a time (extra memory O(``chunk_size`` × V)).

    Returns:
        ``ids`` ``(N, k)`` int64 and ``logprobs`` ``(N, k)`` float32, most likely first (ties among the k: the
        lower id first; a tie at the k-th place keeps the one ``torch.topk`` picks), and ``next_logprobs``
        ``(N,)`` float32, the log-prob of ``next_tokens`` (None without them).
    """
    vocab = head.weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary size), got {k}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    ids, logprobs, label_logprobs = [], [], []
    for start in range(0, hidden.shape[0], chunk_size):
        log_probs = torch.log_softmax(head.logits(hidden[start : start + chunk_size]).float(), dim=-1)
        # a partial selection (a full sort of V per position costs ~50x more at V = 32000); then the k kept are
        # ordered most likely first, ties by id, so the order does not depend on the selection's internals
        top, order = log_probs.topk(k, dim=-1)
        order, by_id = order.sort(dim=-1)
        top, by_value = top.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        ids.append(order.gather(-1, by_value))
        logprobs.append(top)
        if next_tokens is not None:
            rows = next_tokens[start : start + chunk_size].to(log_probs.device).unsqueeze(-1)
            label_logprobs.append(log_probs.gather(-1, rows).squeeze(-1))
    width = (0, k)
    out_ids = torch.cat(ids) if ids else hidden.new_zeros(width, dtype=torch.long)
    out_logprobs = torch.cat(logprobs) if logprobs else hidden.new_zeros(width, dtype=torch.float32)
    if next_tokens is None:
        return out_ids, out_logprobs, None
    return out_ids, out_logprobs, (torch.cat(label_logprobs) if label_logprobs else hidden.new_zeros(0))
