"""The in-process teacher: a frozen causal LM that lives in the LightningModule (``GKDModule.teacher``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightning_gkd.ops.divergence.topk import topk_log_probs
from lightning_gkd.ops.hf.heads import LogitHead, hidden_states_and_head
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits
from lightning_gkd.teachers.base import TeacherBase, TopKSignal, next_tokens


class LocalTeacher(TeacherBase):
    """Reads the signal from ``model`` itself (kept by reference: moving, casting or sharding the module in place is
    seen here). ``top_k``: what ``topk`` keeps (None: the whole vocabulary); the dense methods ignore it."""

    def __init__(self, model: nn.Module, *, top_k: int | None = None, chunk_size: int = 256) -> None:
        self.model = model
        self.top_k = top_k
        self.chunk_size = chunk_size

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_logits(self.model, batch)

    @torch.no_grad()
    def hidden_states(
        self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[torch.Tensor, LogitHead]:
        return hidden_states_and_head(
            self.model, batch["input_ids"], batch["attention_mask"], positions, batch.get("vision")
        )

    @torch.no_grad()
    def topk(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> TopKSignal:
        """The model's top-``top_k`` log-probs at ``positions`` (what a cache built from it, or a server serving it,
        returns), and the log-prob of each following token."""
        hidden, head = self.hidden_states(batch, positions)
        k = self.top_k if self.top_k is not None else head.weight.shape[0]
        ids, logprobs, following = topk_log_probs(
            hidden, head, k, next_tokens=next_tokens(batch["input_ids"], positions), chunk_size=self.chunk_size
        )
        return TopKSignal(ids, logprobs, following)
