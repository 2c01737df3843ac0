"""SFTModule: supervised fine-tuning, cross-entropy on completion tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from lightning_gkd.evaluation.settings import ValidationSettings
from lightning_gkd.losses.base import LossOutput
from lightning_gkd.methods.base import CausalLMModule, Group
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.training.settings import TrainingSettings


class SFTModule(CausalLMModule):
    """Next-token cross-entropy on completion tokens (labels != -100), averaged over those tokens (over the whole
    optimizer step's with ``training.loss_normalization="step"``, the default).

    ``training`` (``TrainingSettings``) and ``validation`` (``ValidationSettings``): as ``GKDModule``'s; each takes the
    settings, a mapping of overrides of the defaults, or None.
    """

    def __init__(
        self,
        model: ModelSource,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        training: Group[TrainingSettings] = None,
        validation: Group[ValidationSettings] = None,
    ) -> None:
        super().__init__(model, tokenizer, training=training, validation=validation)
        self.save_settings("model", "tokenizer")

    def completion_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        logits = self.causal_lm_logits(self.model, batch)[:, :-1]
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        count = mask.sum()
        if not mask.any():
            return LossOutput(logits.sum() * 0.0, count)
        return LossOutput(F.cross_entropy(logits[mask].float(), labels[mask]), count)

    def completion_requirement(self) -> str | None:
        return (
            "SFTModule trains on the dataset completions only. End every training row with an assistant "
            "message (the completion to learn)."
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        return self.finish_training_step(self.completion_loss(batch), batch)
