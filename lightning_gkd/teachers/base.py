"""The teacher protocol."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from lightning_gkd.ops.hf import LogitHead


@runtime_checkable
class Teacher(Protocol):
    """The teacher's view of a batch (``input_ids``, ``attention_mask`` ``(B, L)``, left-padded), without
    gradients."""

    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``(B, L, V)`` next-token logits at every position."""
        ...

    def hidden_states(
        self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[torch.Tensor, LogitHead]:
        """``(N, H)`` final hidden states at the ``N`` True ``positions`` ``(B, L)`` (row-major), and the head
        (``LogitHead``: projection, bias, scale, soft-cap) that turns them into exactly the teacher's logits. Raises
        ``LeanForwardUnsupported`` when the source cannot (the loss then falls back to ``logits``)."""
        ...
