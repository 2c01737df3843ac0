"""An embedding lookup whose weight gradient holds the rows looked up only: a sparse COO tensor, for a weight whose
dense gradient another use of it (a tied output head) already makes, so autograd adds the few rows in place instead
of torch's dense backward zero-filling a ``(V, H)`` tensor, index-adding into it and adding it to the head's."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["RowsDelivery", "embedding_rows_gradient"]


class _RowsGradientEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, deliver) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx = padding_idx
        ctx.deliver = deliver
        ctx.weight_options = {"dtype": weight.dtype, "device": weight.device}
        ctx.weight_shape = weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        grads = grad_output.reshape(flat.shape[0], -1)
        rows, inverse = torch.unique(flat, return_inverse=True)
        # duplicates summed from zero in input order, as torch's dense embedding backward sums them
        values = grads.new_zeros(rows.shape[0], grads.shape[1]).index_add_(0, inverse, grads)
        if ctx.padding_idx is not None:
            padding = ctx.padding_idx % ctx.weight_shape[0]  # F.embedding takes a negative padding_idx too
            values.masked_fill_((rows == padding).unsqueeze(1), 0)
        if ctx.deliver is not None and ctx.deliver(rows, values):  # added into the weight's gradient by the caller
            return None, torch._efficientzerotensor(ctx.weight_shape, **ctx.weight_options), None, None
        grad_weight = torch.sparse_coo_tensor(
            rows.unsqueeze(0), values, ctx.weight_shape, is_coalesced=True, check_invariants=False
        )
        return None, grad_weight, None, None


#: (rows (U,), summed row gradients (U, H)) -> whether the caller adds them into the weight's gradient itself
RowsDelivery = Callable[[torch.Tensor, torch.Tensor], bool]


def embedding_rows_gradient(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None, deliver: RowsDelivery | None = None
) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)``: ``(*, H)`` rows of ``weight`` ``(V, H)`` for integer ``ids``
    ``(*)``, whose gradient with respect to ``weight`` is a coalesced sparse COO ``(V, H)`` tensor holding only the
    ``U`` distinct rows looked up: ``∂/∂W[r] = Σ_{i: ids_i = r} ∂/∂out_i`` (summed from zero in input order, as
    torch's dense backward sums them), zero for ``padding_idx``.

    Autograd adds it into the weight's other gradient where that is dense (a tied output head's): in place, row by
    row, the same sums as the dense path's ``head + embedding`` (bit-equal on CPU). Alone, the weight's ``.grad``
    would be sparse, which most optimizers reject: see ``models.tied_embedding``. Autograd adds a sparse gradient into
    a dense one out of place (a fresh ``(V, H)`` tensor); ``deliver``, when given and when it returns True for the
    ``(rows, values)``, takes the rows to add into the weight's gradient itself, and the weight gets a zero tensor
    that allocates nothing (``torch._efficientzerotensor``) instead."""
    return _RowsGradientEmbedding.apply(ids, weight, padding_idx, deliver)
