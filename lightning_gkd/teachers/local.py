"""The in-process teacher: a frozen causal LM that lives in the LightningModule (``GKDModule.teacher``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_gkd.ops.hf import LogitHead, causal_lm_logits, check_output_head, final_hidden_states, output_head


class LocalTeacher:
    """Reads the signal from ``model`` itself (kept by reference: moving, casting or sharding the module in place is
    seen here)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_logits(self.model, batch)

    @torch.no_grad()
    def hidden_states(
        self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[torch.Tensor, LogitHead]:
        check_output_head(self.model, batch["input_ids"], batch["attention_mask"])
        hidden = final_hidden_states(self.model, batch["input_ids"], batch["attention_mask"], positions)
        return hidden, output_head(self.model)  # after the forward: FSDP2 has gathered the root unit
