"""A tied input embedding whose gradient is its looked-up rows only, added into the output head's dense gradient.

A causal LM with tied word embeddings uses one ``(V, H)`` weight twice: as the input embedding and as the output
head. The head's gradient is dense; torch's embedding backward makes a second dense ``(V, H)`` gradient (a zero-fill
and an index-add of the few rows the batch looked up) that autograd then adds to it, at Qwen2.5-0.5B shapes a 545 MB
buffer and about half a second per step on CPU. :func:`sparse_tied_embedding_gradient` swaps such an embedding's
lookup for ``ops.embedding.embedding_rows_gradient``, whose gradient holds the rows looked up only: autograd adds them
into the head's gradient, the same sums as before (bit-equal on CPU).

Not wired into the modules by default: autograd's input buffer adds a sparse gradient into a dense one out of place
(torch 2.13 counts sparse tensors as "subclass-like", so ``InputBuffer`` computes ``dense + sparse`` into a fresh
``(V, H)`` tensor instead of ``dense.add_(sparse)``), so the 545 MB allocation and its page faults remain and the
backward measured no faster at Qwen2.5-0.5B's shapes (``scripts/bench.py``'s ``tied_rows`` lever). Adding the rows
in place needs the rows delivered after the head's gradient without a sparse tensor in the buffer (for instance a
pre-hook on the weight's ``AccumulateGrad`` node).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_gkd.ops.embedding import embedding_rows_gradient

__all__ = ["RowsGradientEmbedding", "sparse_tied_embedding_gradient"]


class RowsGradientEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight gradient is a sparse COO tensor of the rows looked up
    (``embedding_rows_gradient``); its ``sparse`` flag stays False: DDP expects the weight's ``.grad`` dense."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return embedding_rows_gradient(input, self.weight, self.padding_idx)


def _dense_grad(weight: torch.Tensor) -> None:
    """The weight's ``.grad`` dense when the head did not take part in a backward (only the sparse rows came)."""
    if weight.grad is not None and weight.grad.is_sparse:
        weight.grad = weight.grad.to_dense()


def sparse_tied_embedding_gradient(model: nn.Module) -> bool:
    """Make the input embedding of ``model`` (a Hugging Face causal LM, possibly wrapped by PEFT) a
    :class:`RowsGradientEmbedding` when that is exact: its weight is trainable and is the output projection's weight
    (tied), and it is a plain ``nn.Embedding`` (no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``; not a subclass
    with its own forward, such as Gemma's scaled embedding). Returns whether it did. An untied or frozen embedding
    keeps torch's path. Should a backward reach the embedding without the head, a hook makes the weight's ``.grad``
    dense again, so optimizers (fused AdamW) always see a dense gradient. Under FSDP2 the root unit holds both uses
    of the weight and gathers it whole for the forward, so the rows are added into its whole gradient there too."""
    get_input, get_output = (getattr(model, name, None) for name in ("get_input_embeddings", "get_output_embeddings"))
    if not callable(get_input) or not callable(get_output):
        return False
    embedding, head = get_input(), get_output()
    weight = getattr(embedding, "weight", None)
    if (
        type(embedding) is not nn.Embedding
        or head is None
        or weight is None
        or getattr(head, "weight", None) is not weight
        or not weight.requires_grad
        or embedding.max_norm is not None
        or embedding.scale_grad_by_freq
        or embedding.sparse
    ):
        return False
    embedding.__class__ = RowsGradientEmbedding
    weight.register_post_accumulate_grad_hook(_dense_grad)
    return True
