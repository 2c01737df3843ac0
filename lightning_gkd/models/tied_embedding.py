"""A tied input embedding whose gradient is its looked-up rows only, added into the output head's dense gradient.

A causal LM with tied word embeddings uses one ``(V, H)`` weight twice: as the input embedding and as the output
head. The head's gradient is dense; torch's embedding backward makes a second dense ``(V, H)`` gradient (a zero-fill
and an index-add of the few rows the batch looked up) that autograd then adds to it, at Qwen2.5-0.5B shapes a 545 MB
buffer and about half a second per step on CPU. :func:`sparse_tied_embedding_gradient` swaps such an embedding's
lookup for ``ops.embedding.embedding_rows_gradient``, whose gradient holds the rows looked up only: autograd adds them
into the head's gradient, the same sums as before (bit-equal on CPU).

Autograd's input buffer would add a sparse gradient into the dense one out of place (torch counts sparse tensors as
"subclass-like"), into a fresh ``(V, H)`` tensor: the allocation and its page faults would stay. So the rows go to a
pre-hook on the weight's ``AccumulateGrad`` node instead, which adds them in place into the summed gradient it is
about to accumulate (the head's, bit-equal to ``head + dense embedding gradient``); the embedding's own edge carries
a zero tensor that allocates nothing. Where that node will not run (``torch.autograd.grad``) or the weight is another
tensor than the one hooked (FSDP2's gathered copy, a deep copy), the rows go as a sparse gradient: exact, not faster.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.hf.embedding import embedding_rows_gradient

__all__ = ["RowsGradientEmbedding", "sparse_tied_embedding_gradient"]


class RowsGradientEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight gradient is a sparse COO tensor of the rows looked up
    (``embedding_rows_gradient``); its ``sparse`` flag stays False: DDP expects the weight's ``.grad`` dense."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        sink = self.__dict__.get("_rows_sink")
        deliver = sink if isinstance(sink, _RowsIntoGradient) and sink.holds(self.weight) else None
        return embedding_rows_gradient(input, self.weight, self.padding_idx, deliver)


def _no_sink() -> None:
    return None


class _RowsIntoGradient:
    """Takes the embedding's rows in its backward and adds them, in order, into the weight's summed gradient in a
    pre-hook of the weight's ``AccumulateGrad`` node (kept alive here, as DDP keeps it, so the hook stays)."""

    def __init__(self, weight: nn.Parameter) -> None:
        self._weight = weakref.ref(weight)
        self._shape = weight.shape
        view = weight.view_as(weight).grad_fn
        accumulator = view.next_functions[0][0] if view is not None else None
        if accumulator is None:
            raise ValueError("the tied embedding's weight must require gradients")
        self._accumulator: torch.autograd.graph.Node = accumulator
        self._accumulator.register_prehook(self._add)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def holds(self, weight: torch.Tensor) -> bool:
        return self._weight() is weight

    def __call__(self, rows: torch.Tensor, values: torch.Tensor) -> bool:
        try:  # only a backward that accumulates into .grad runs the node (autograd.grad raises here)
            if not torch._C._will_engine_execute_node(self._accumulator):
                return False
        except RuntimeError:
            return False
        self._pending.append((rows, values))
        return True

    def _add(self, grads: tuple[Any, ...]) -> tuple[torch.Tensor] | None:
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        grad = grads[0]
        if grad._is_zerotensor():  # only the rows came (no head in this backward): a dense gradient of them
            grad = torch.zeros(self._shape, dtype=grad.dtype, device=grad.device)
        # the buffer's sum is this node's own (made in place, or fresh): adding in place touches nothing else
        for rows, values in pending:
            grad.index_add_(0, rows, values)
        return (grad,)

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles of the module hold other weights: no sink
        return (_no_sink, ())


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
    found = getattr(embedding, "weight", None)
    if type(embedding) is not nn.Embedding or head is None or not isinstance(found, nn.Parameter):
        return False
    weight = found
    if (
        getattr(head, "weight", None) is not weight
        or not weight.requires_grad
        or embedding.max_norm is not None
        or embedding.scale_grad_by_freq
        or embedding.sparse
    ):
        return False
    embedding.__class__ = RowsGradientEmbedding
    setattr(embedding, "_rows_sink", _RowsIntoGradient(weight))  # noqa: B010 - a plain attribute of the module
    weight.register_post_accumulate_grad_hook(_dense_grad)
    return True
