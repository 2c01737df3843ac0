"""Models over one tokenizer padded to different vocabulary rows (Qwen2.5-7B's 152,064 against 0.5B's 151,936), and
the same models truncated to the rows they share: the reference a shared-range loss must equal."""

from __future__ import annotations

import copy

import torch
from torch import nn


@torch.no_grad()
def pad_vocabulary(model: nn.Module, rows: int, *, seed: int, scale: float = 1.0) -> nn.Module:
    """``model`` resized in place to ``rows`` embedding and head rows; the new rows are random (``scale`` times the
    spread of the existing ones), so a loss that read them would differ from one over the first rows."""
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows, mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    for weight in {
        id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
    }.values():
        spread = float(weight[:old].std())
        weight[old:] = torch.randn(rows - old, weight.shape[1], generator=generator) * spread * scale
    return model


def truncated_copy(model: nn.Module, rows: int) -> nn.Module:
    """A deep copy of ``model`` with only its first ``rows`` embedding and head rows."""
    out = copy.deepcopy(model)
    out.resize_token_embeddings(rows, mean_resizing=False)
    return out
