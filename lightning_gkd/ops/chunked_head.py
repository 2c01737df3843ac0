"""The chunked-head driver the hidden-state losses share (``chunked_jsd``, ``sparse_kd``): project a chunk of
positions to logits, let a chunk loss give its value and logit gradient, fold that gradient into the hidden states'
and the head's gradients, drop the logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_gkd.ops.hf import LogitHead

__all__ = ["ChunkLoss", "check_hidden_and_head", "check_token_ids", "folded_head_loss", "head_logits"]

# (logits (C, V) float32, the chunk's rows, need_grad) -> (summed loss, d loss / d logits or None)
ChunkLoss = Callable[[torch.Tensor, slice, bool], tuple[torch.Tensor, torch.Tensor | None]]


def head_logits(hidden: torch.Tensor, head: LogitHead) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """``(logits, d logits / d (h @ Wᵀ + b))`` in float32 for ``hidden`` ``(C, H)``: ``LogitHead.transform``."""
    projected = (hidden @ head.weight.t()).float()
    if head.bias is not None:
        projected = projected + head.bias.float()
    return head.transform(projected)


class _FoldedHeadLoss(torch.autograd.Function):
    """Runs ``chunk_loss`` over the positions a chunk at a time, folding each chunk's logit gradient into the
    gradients of the hidden states, weight and bias during the forward pass."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: LogitHead,
        chunk_loss: ChunkLoss,
        chunk_size: int,
        normalizer: float,
        grads: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        grad_hidden, grad_weight, grad_bias = grads
        need_grad = any(grads)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hidden_grad = torch.zeros_like(hidden, dtype=torch.float32) if grad_hidden else None
        weight_grad = torch.zeros_like(weight, dtype=torch.float32) if grad_weight else None
        bias_grad = torch.zeros_like(bias, dtype=torch.float32) if grad_bias and bias is not None else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            hs = hidden[rows]
            logits, head_grad = head_logits(hs, head)
            loss, logit_grad = chunk_loss(logits, rows, need_grad)
            total += loss
            if logit_grad is not None:
                if head_grad is not None:  # through the head's scale and soft-cap, to h @ Wᵀ + b
                    logit_grad = logit_grad * head_grad
                if bias_grad is not None:
                    bias_grad += logit_grad.sum(dim=0)
                if weight_grad is not None:
                    weight_grad.addmm_(logit_grad.t(), hs.float())
                if hidden_grad is not None:
                    hidden_grad[rows] = logit_grad.to(weight.dtype) @ weight
        ctx.save_for_backward(
            *(g / normalizer if g is not None else torch.empty(0) for g in (hidden_grad, weight_grad, bias_grad))
        )
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.has = (grad_hidden, grad_weight, bias_grad is not None)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grads = [
            (saved * grad_output).to(dtype) if has else None
            for saved, has, dtype in zip(ctx.saved_tensors, ctx.has, ctx.dtypes, strict=True)
        ]
        return *grads, None, None, None, None, None


def folded_head_loss(
    hidden: torch.Tensor, head: LogitHead, chunk_loss: ChunkLoss, chunk_size: int, normalizer: float
) -> torch.Tensor:
    """``Σ_chunks chunk_loss(logits of the chunk) / normalizer`` for ``hidden`` ``(N, H)`` through ``head``, with
    O(``chunk_size`` × V) extra memory: each chunk's logits ``(C, V)`` (float32) exist only while ``chunk_loss``
    turns them into the chunk's summed loss and, when autograd needs it, its gradient with respect to them, which
    is folded into the gradients of ``hidden``, ``head.weight`` and ``head.bias`` at once (through the head's scale
    and soft-cap); the backward pass only scales those by the incoming gradient."""
    enabled = torch.is_grad_enabled()
    bias = head.bias
    grads = (
        enabled and hidden.requires_grad,
        enabled and head.weight.requires_grad,
        enabled and bias is not None and bias.requires_grad,
    )
    return _FoldedHeadLoss.apply(hidden, head.weight, bias, head, chunk_loss, int(chunk_size), normalizer, grads)


def check_hidden_and_head(
    hidden: torch.Tensor, head: LogitHead, chunk_size: int, num_items_in_batch: int | torch.Tensor | None
) -> float:
    """The checks every hidden-state loss makes: ``hidden`` ``(N, H)``, the heads weight ``(V, H)``, ``chunk_size``;
    returns the normaliser (``num_items_in_batch``, else ``N``)."""
    if hidden.dim() != 2:
        raise ValueError(f"student_hidden must be (N, H), got shape {tuple(hidden.shape)}.")
    if head.weight.dim() != 2 or head.weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"The student head's weight {tuple(head.weight.shape)} is not (V, H) with H = {hidden.shape[1]}, the "
            "student_hidden feature size."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if num_items_in_batch is None:
        return float(max(hidden.shape[0], 1))
    return float(num_items_in_batch)


def check_token_ids(name: str, ids: torch.Tensor, vocab: int) -> None:
    """``ids`` are integer token ids in ``[0, vocab)`` (one host sync for the range)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}.")
    if ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.stack([ids.min(), ids.max()]).tolist())
    if low < 0 or high >= vocab:
        raise ValueError(f"{name} must be in [0, {vocab}) (the student's vocabulary), got ids from {low} to {high}.")
