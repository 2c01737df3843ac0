"""The chunked-head driver the hidden-state losses share (``chunked_jsd``, ``sparse_kd``): project a chunk of
positions to logits, let a chunk loss give its value and logit gradient, fold that gradient into the hidden states'
and the head's gradients, drop the logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_gkd.ops.hf.heads import LogitHead

__all__ = [
    "ChunkLoss",
    "check_hidden_and_head",
    "check_token_ids",
    "folded_head_loss",
    "head_finish",
    "head_logits",
    "head_projection",
]

# (logits (C, V) float32, the chunk's rows, need_grad) -> (summed loss, d loss / d logits or None); the driver owns
# both the logits and the returned gradient afterwards (it may overwrite them), so a chunk loss may return the
# gradient in the logits' own storage.
ChunkLoss = Callable[[torch.Tensor, slice, bool], tuple[torch.Tensor, torch.Tensor | None]]


def head_projection(hidden: torch.Tensor, head: LogitHead, out: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden @ weightᵀ`` ``(C, V)`` in the operands' dtype, written into ``out`` (a contiguous buffer of that
    shape and dtype, reused across chunks so no fresh ``C × V`` block is faulted in each time) when it fits."""
    if out is not None and out.dtype == hidden.dtype == head.weight.dtype:
        return torch.mm(hidden, head.weight.t(), out=out)
    return hidden @ head.weight.t()


def head_finish(
    projected: torch.Tensor, head: LogitHead, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """``(logits, d logits / d (h @ Wᵀ + b))`` in float32 from ``projected = h @ Wᵀ`` (any dtype): the bias and
    ``LogitHead.transform``, elementwise, so it may run on any rows of a projection; ``in_place``: the bias is added
    into ``projected`` when it is float32 already."""
    projected = projected.float()
    if head.bias is not None:
        bias = head.bias.float()
        projected = projected.add_(bias) if in_place else projected + bias
    return head.transform(projected)


def head_logits(hidden: torch.Tensor, head: LogitHead) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """``(logits, d logits / d (h @ Wᵀ + b))`` in float32 for ``hidden`` ``(C, H)``: ``LogitHead.transform``."""
    return head_finish(head_projection(hidden, head), head)


class _FoldedHeadLoss(torch.autograd.Function):
    """Runs ``chunk_loss`` over the positions a chunk at a time, folding each chunk's logit gradient into the
    gradients of the hidden states, weight and bias during the forward pass.

    One float32 ``(chunk_size, V)`` buffer holds every chunk's projection in turn (the last, shorter chunk uses its
    first rows); the weight's gradient starts from the first chunk's product (no zero-filled ``V × H`` pass); the
    gradients are divided by the normaliser in place, and the backward pass scales them in place (skipped for an
    incoming gradient of exactly 1 on the CPU), so it runs once: ``retain_graph`` is not supported."""

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
        dense = torch.contiguous_format
        hidden_grad = torch.empty_like(hidden, dtype=torch.float32, memory_format=dense) if grad_hidden else None
        weight_grad = torch.empty_like(weight, dtype=torch.float32) if grad_weight else None
        bias_grad = torch.zeros_like(bias, dtype=torch.float32) if grad_bias and bias is not None else None
        rows_total = hidden.shape[0]
        fp32 = hidden.dtype == weight.dtype == torch.float32
        buffer = hidden.new_empty((min(chunk_size, rows_total), weight.shape[0])) if fp32 else None
        for start in range(0, rows_total, chunk_size):
            rows = slice(start, min(start + chunk_size, rows_total))
            hs = hidden[rows]
            projected = head_projection(hs, head, out=None if buffer is None else buffer[: hs.shape[0]])
            logits, head_grad = head_finish(projected, head, in_place=True)
            loss, logit_grad = chunk_loss(logits, rows, need_grad)
            total += loss
            if logit_grad is not None:
                if head_grad is not None:  # through the head's scale and soft-cap, to h @ Wᵀ + b
                    logit_grad = logit_grad.mul_(head_grad)
                if bias_grad is not None:
                    bias_grad += logit_grad.sum(dim=0)
                if weight_grad is not None:
                    if start == 0:
                        torch.mm(logit_grad.t(), hs.float(), out=weight_grad)
                    else:
                        weight_grad.addmm_(logit_grad.t(), hs.float())
                if hidden_grad is not None:
                    if weight.dtype == torch.float32:
                        torch.mm(logit_grad, weight, out=hidden_grad[rows])
                    else:
                        hidden_grad[rows] = logit_grad.to(weight.dtype) @ weight
        if rows_total == 0:
            for g in (hidden_grad, weight_grad):
                if g is not None:
                    g.zero_()
        ctx.grads = [g.div_(normalizer) if g is not None else None for g in (hidden_grad, weight_grad, bias_grad)]
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError(
                "The chunked hidden-state loss computed its gradients during the forward pass and hands them over "
                "once; call backward on it once (retain_graph=True with a second backward is not supported)."
            )
        saved, ctx.grads = ctx.grads, None
        one = grad_output.device.type == "cpu" and grad_output.item() == 1.0  # no host sync on the CPU
        grads = [
            None if g is None else (g if one else g.mul_(grad_output)).to(dtype)
            for g, dtype in zip(saved, ctx.dtypes, strict=True)
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
