"""Plumbing shared by every method: the trainable model, frozen helpers, optimizers, generation metrics,
checkpoints and export."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation import GenerationMetric, greedy_texts, reference_texts
from lightning_gkd.generation import position_ids_from_mask, resolve_eos_token_id
from lightning_gkd.models import ModelSource, freeze, load_causal_lm
from lightning_gkd.models import disable_dropout as disable_dropout_in

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (run seed, step, ...): the same on every rank and after resume."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


class CausalLMModule(L.LightningModule):
    """Base LightningModule: a trainable causal LM (``self.model``) plus frozen models named in ``frozen_names``.

    Frozen models stay in eval mode whatever ``train()`` is called with, take no optimizer slot, and are kept out
    of checkpoints (they are re-inserted from the live module on load, so loading stays strict for the rest).

    Subclasses implement ``training_step`` and ``dataset_loss(batch)`` (the validation loss on dataset
    completions). ``metrics`` (name -> ``fn(predictions, references) -> float``) score greedy completions of the
    validation prompts against the dataset completions once per validation epoch, logged as ``val/<name>``.
    """

    frozen_names: tuple[str, ...] = ()
    model_role = "model"  # what errors call the trainable model ("student", "policy")

    def __init__(self, model: ModelSource, tokenizer: PreTrainedTokenizerBase | str, *,
                 optimizer: OptimizerFactory | None = None, scheduler: SchedulerFactory | None = None,
                 disable_dropout: bool = True, gradient_checkpointing: bool = False,
                 trust_remote_code: bool = False, seed: int = 0,
                 metrics: Mapping[str, GenerationMetric] | None = None, eval_max_new_tokens: int = 32) -> None:
        super().__init__()
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # from_pretrained returns eval-mode models; Lightning keeps module modes as found, so set train mode here.
        self.model = load_causal_lm(model, trust_remote_code=trust_remote_code, role=self.model_role).train()
        if disable_dropout:
            disable_dropout_in(self.model)
        if gradient_checkpointing:
            # transformers >= 5.2x renamed gradient_checkpointing_enable (now deprecated) to activation_*.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=5e-5)
        self.scheduler_factory = scheduler
        self.seed = seed
        self.metrics = dict(metrics or {})
        self.eval_max_new_tokens = eval_max_new_tokens
        self._predictions: list[str] = []
        self._references: list[str] = []

    def load_frozen(self, source: ModelSource, *, role: str, trust_remote_code: bool = False) -> nn.Module:
        return freeze(load_causal_lm(source, trust_remote_code=trust_remote_code, role=role))

    # -- modes, optimizers --------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "CausalLMModule":
        super().train(mode)
        for name in self.frozen_names:
            getattr(self, name).eval()
        return self

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}

    # -- forward ------------------------------------------------------------------------------------------------
    @staticmethod
    def causal_lm_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits (B, L, V) of ``model`` on a left-padded batch, with positions counted from each row's first
        real token (the same positions the sampler uses)."""
        mask = batch["attention_mask"]
        return model(input_ids=batch["input_ids"], attention_mask=mask,
                     position_ids=position_ids_from_mask(mask), use_cache=False).logits

    def step_seed(self, batch_idx: int, *salt: int) -> int:
        """Seed for this training batch: a function of (seed, global step, batch index, salt) only."""
        return derive_seed(self.seed, self.global_step, batch_idx, *salt)

    # -- validation: loss on dataset completions + generation metrics -------------------------------------------
    def dataset_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.dataset_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        if self.metrics:
            eos = resolve_eos_token_id(self.model, self.tokenizer)
            self._predictions += greedy_texts(self.model, self.tokenizer, batch, eos_token_id=eos,
                                              max_new_tokens=self.eval_max_new_tokens)
            self._references += reference_texts(self.tokenizer, batch, eos)
        return loss

    def on_validation_epoch_end(self) -> None:
        if not self.metrics:
            return
        predictions, references = self._predictions, self._references
        self._predictions, self._references = [], []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (predictions, references))
            predictions = [p for preds, _ in gathered for p in preds]
            references = [r for _, refs in gathered for r in refs]
        for name, metric in self.metrics.items():
            self.log(f"val/{name}", float(metric(predictions, references)), prog_bar=True)

    # -- checkpoints and export ---------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        prefixes = tuple(f"{name}." for name in self.frozen_names)
        if prefixes:
            state = checkpoint["state_dict"]
            for key in [k for k in state if k.startswith(prefixes)]:
                del state[key]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        for name in self.frozen_names:
            for key, value in getattr(self, name).state_dict().items():
                state.setdefault(f"{name}.{key}", value)

    def export(self, path: str | Path) -> Path:
        """Write the trained model and tokenizer with ``save_pretrained`` to ``path``, loadable with
        ``AutoModelForCausalLM.from_pretrained(path)``. Written beside ``path`` first and then renamed, so an
        interrupted export never replaces a good one with a half-written folder."""
        target = Path(path).expanduser().resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            self.model.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
            if target.exists():
                old = target.with_name(f".{target.name}-old")
                shutil.rmtree(old, ignore_errors=True)
                target.rename(old)
                staging.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target
