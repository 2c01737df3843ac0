"""The sampler protocol."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Sampler(Protocol):
    """Samples one completion per prompt with ``model``; a method calls it once per generation group."""

    def sample(
        self, model: nn.Module, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int
    ) -> dict[str, torch.Tensor]:
        """Completions for left-padded ``prompts`` ``(B, P)``, reproducible for a given ``seed``.

        Returns the training batch of ``lightning_gkd.ops.sampling.completion_batch``: ``input_ids``,
        ``attention_mask`` and ``labels``, each ``(B, P + N)``: the prompt columns as given (labels -100), then the
        completion up to and including its first EOS (attention 0 and labels -100 after it).
        """
        ...
