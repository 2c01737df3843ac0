"""``embedding_rows_gradient``: the lookup of ``F.embedding`` with a sparse gradient of the rows looked up, which
autograd adds into a tied head's dense gradient to the same values as torch's dense path (bit-equal on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_gkd.ops.hf.embedding import embedding_rows_gradient


def tied_grad(lookup, ids, weight, padding_idx, dtype=torch.float32):
    """The gradient of a loss using ``weight`` as embedding and as head, with ``lookup`` for the embedding."""
    w = weight.detach().to(dtype).requires_grad_(True)
    x = lookup(ids, w, padding_idx)  # (B, L, H)
    mix = torch.linspace(-1, 1, ids.shape[1], dtype=dtype)[None, :, None]
    hidden = torch.tanh(x * mix + x.cumsum(1))
    loss = torch.logsumexp(hidden @ w.t(), -1).sum() + (hidden**2).sum()
    loss.backward()
    return w.grad


@pytest.mark.parametrize("padding_idx", [None, 0, -3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_gradient_equals_the_dense_path_bit_for_bit(padding_idx, dtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 8, generator=generator)
    ids = torch.randint(0, 12, (3, 17), generator=generator)  # many repeats (some 5+ times), padding ids among them
    ids[0, :6] = 5
    expected = tied_grad(F.embedding, ids, weight, padding_idx, dtype)
    got = tied_grad(embedding_rows_gradient, ids, weight, padding_idx, dtype)
    assert not got.is_sparse and got.dtype == dtype
    assert torch.equal(got, expected)


def test_forward_is_f_embedding_and_the_gradient_holds_the_rows_looked_up_only():
    weight = torch.randn(10, 3, requires_grad=True)
    ids = torch.tensor([[4, 1, 4], [0, 4, 7]])
    out = embedding_rows_gradient(ids, weight, padding_idx=0)
    assert torch.equal(out, F.embedding(ids, weight, padding_idx=0))
    grad_out = torch.arange(18.0).reshape(2, 3, 3)
    out.backward(grad_out)
    grad = weight.grad
    assert grad.is_sparse and grad.shape == (10, 3)
    assert grad._indices().tolist() == [[0, 1, 4, 7]]
    values = grad._values()
    assert torch.equal(values[0], torch.zeros(3))  # padding_idx gets no gradient
    assert torch.equal(values[1], grad_out[0, 1])
    assert torch.equal(values[2], grad_out[0, 0] + grad_out[0, 2] + grad_out[1, 1])
    assert torch.equal(values[3], grad_out[1, 2])


def test_a_frozen_weight_gets_no_gradient_and_no_graph():
    weight = torch.randn(10, 3)
    out = embedding_rows_gradient(torch.tensor([1, 2]), weight)
    assert out.grad_fn is None and not out.requires_grad
