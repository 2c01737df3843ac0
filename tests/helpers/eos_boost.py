"""A model whose greedy answers stop early: its EOS logit raised by a bias on the output head."""

from __future__ import annotations

import torch


def boost_eos(model: torch.nn.Module, tokenizer, amount: float = 100.0) -> torch.nn.Module:
    """``model`` with a bias on its output head that raises the EOS (``<|im_end|>``) logit by ``amount`` everywhere
    (large: its greedy answer is EOS at once). A head the lean loss path still describes (``hidden @ W.T + bias``)."""
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[tokenizer.convert_tokens_to_ids("<|im_end|>")] = amount
    model.lm_head = biased
    return model
