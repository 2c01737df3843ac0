"""The in-process teacher: a frozen causal LM that lives in the LightningModule (``GKDModule.teacher``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.decoding.speculative import ModelVerifier
from lightning_gkd.ops.divergence.topk import topk_log_probs
from lightning_gkd.ops.hf.forward import unwrap
from lightning_gkd.ops.hf.heads import LogitHead, hidden_states_and_head
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits, image_token_id
from lightning_gkd.teachers.base import TeacherBase, TopKSignal, next_tokens


class LocalTeacher(TeacherBase):
    """Reads the signal from ``model`` itself (kept by reference: moving, casting or sharding the module in place is
    seen here). ``top_k``: what ``topk`` keeps (None: the whole vocabulary); the dense methods ignore it."""

    def __init__(self, model: nn.Module, *, top_k: int | None = None, chunk_size: int = 256) -> None:
        self.model = model
        self.top_k = top_k
        self.chunk_size = chunk_size

    def check_images(self, student: Any) -> None:
        """A teacher reads the rows' images when it is a vision-language model with the student's image token; a text
        teacher would read the image tokens as text."""
        token, expected = image_token_id(self.model), image_token_id(student)
        if token is None:
            raise ValueError(
                f"The rows hold images but the teacher ({type(unwrap(self.model)).__name__}) is a text model: it would "
                "read the image tokens as text. Use a vision-language teacher with the student's tokenizer; a text "
                "teacher that reads only a caption or the text part is not supported yet."
            )
        if token != expected:
            raise ValueError(
                f"The teacher's image token id is {token} but the student's is {expected}: the two vision-language "
                "models do not share a tokenizer and its image token. Use a teacher of the student's family."
            )

    def block_verifier(self, accept_top_k: int) -> ModelVerifier:
        """A verifier of speculative KD's drafts: the model itself, with its KV cache (every log-prob known, any
        ``accept_top_k``)."""
        return ModelVerifier(self.model)

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_logits(self.model, batch)

    @torch.no_grad()
    def hidden_states(self, batch: Mapping[str, Any], positions: torch.Tensor) -> tuple[torch.Tensor, LogitHead]:
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
