"""GKDModule: generalized knowledge distillation (on-policy, supervised and sequence-level KD)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.evaluation import GenerationMetric
from lightning_gkd.generation import generate_completions, resolve_eos_token_id
from lightning_gkd.losses import generalized_jsd_loss
from lightning_gkd.models import ModelSource, check_same_vocab
from lightning_gkd.modules.base import CausalLMModule, NonFinitePolicy, OptimizerFactory, SchedulerFactory

Source = Literal["dataset", "student", "teacher"]
_COIN, _SAMPLE = 0, 1  # salts that keep the coin flip's and the sampler's random streams apart


class GKDModule(CausalLMModule):
    """Distil a frozen ``teacher`` into a trainable ``student`` with the generalized JSD (Agarwal et al., GKD).

    Each training batch: with probability ``lmbda`` the student samples completions for the batch prompts
    (on-policy); otherwise, if ``seq_kd``, the teacher samples them; otherwise the dataset completions are used.
    The loss is ``generalized_jsd_loss(beta)`` between student and teacher next-token distributions at every
    completion position, at ``loss_temperature``. Sampling uses ``temperature``, ``top_k``, ``top_p`` and at most
    ``max_new_tokens`` new tokens, always with the KV cache. The coin flip and the sampler's seed are functions of
    (``seed``, global step, batch index), so every rank flips the same coin and a resumed run repeats them.

    ``student``/``teacher``: an ``nn.Module``, a local folder or hub id, or a spec mapping (see
    ``lightning_gkd.models.load_causal_lm``). ``optimizer``/``scheduler``: factories such as
    ``functools.partial(torch.optim.AdamW, lr=1e-4)`` (Hydra: ``_partial_: true``); the scheduler steps every
    optimizer step. ``nonfinite``: ``"raise"`` (default) stops on a non-finite loss naming the step and the model
    with non-finite logits; ``"skip"`` skips such batches with a warning.
    """

    frozen_names = ("teacher",)
    model_role = "student"

    def __init__(self, student: ModelSource, teacher: ModelSource, tokenizer: PreTrainedTokenizerBase | str, *,
                 lmbda: float = 0.5, beta: float = 0.5, temperature: float = 0.9, loss_temperature: float = 1.0,
                 seq_kd: bool = False, max_new_tokens: int = 128, top_k: int = 0, top_p: float = 1.0,
                 disable_dropout: bool = True, gradient_checkpointing: bool = False,
                 optimizer: OptimizerFactory | None = None, scheduler: SchedulerFactory | None = None,
                 trust_remote_code: bool = False, seed: int = 0,
                 metrics: Mapping[str, GenerationMetric] | None = None, eval_max_new_tokens: int = 32,
                 nonfinite: NonFinitePolicy = "raise") -> None:
        _check_range("lmbda", lmbda, 0.0, 1.0)
        _check_range("beta", beta, 0.0, 1.0)
        for name, value in (("temperature", temperature), ("loss_temperature", loss_temperature)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}.")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        super().__init__(student, tokenizer, optimizer=optimizer, scheduler=scheduler,
                         disable_dropout=disable_dropout, gradient_checkpointing=gradient_checkpointing,
                         trust_remote_code=trust_remote_code, seed=seed, metrics=metrics,
                         eval_max_new_tokens=eval_max_new_tokens, nonfinite=nonfinite)
        self.teacher = self.load_frozen(teacher, role="teacher", trust_remote_code=trust_remote_code)
        check_same_vocab(self.student, self.teacher)
        self.lmbda, self.beta, self.seq_kd = lmbda, beta, seq_kd
        self.temperature, self.loss_temperature = temperature, loss_temperature
        self.max_new_tokens, self.top_k, self.top_p = max_new_tokens, top_k, top_p
        self._batches = self._on_policy_batches = 0
        self.save_hyperparameters(ignore=["student", "teacher", "tokenizer", "optimizer", "scheduler", "metrics"])

    @property
    def student(self) -> torch.nn.Module:
        """The trainable model (``self.model``)."""
        return self.model

    def completion_requirement(self) -> str | None:
        if self.lmbda >= 1 or self.seq_kd:
            return None
        return (f"GKDModule(lmbda={self.lmbda}, seq_kd=False) trains on the dataset completions in about "
                f"{1 - self.lmbda:.0%} of the steps. End every training row with an assistant message, or train "
                "without dataset completions: lmbda=1.0 (student samples only; Hydra: method.lmbda=1.0) or "
                "seq_kd=True (teacher samples; method.seq_kd=true).")

    def on_train_start(self) -> None:
        super().on_train_start()
        self._batches = self._on_policy_batches = 0

    # -- the GKD step -------------------------------------------------------------------------------------------
    def choose_source(self, batch_idx: int) -> Source:
        """The λ coin flip: "student" (on-policy) with probability lmbda, else "teacher" if seq_kd, else "dataset"."""
        coin = torch.Generator().manual_seed(self.step_seed(batch_idx, _COIN))
        if torch.rand((), generator=coin).item() < self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "dataset"

    def sample_batch(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
        """Replace the batch completions by ``model``'s samples for its prompts."""
        pad_id = self.tokenizer.pad_token_id
        sampled = generate_completions(
            model, batch["prompts"], batch["prompt_attention_mask"], max_new_tokens=self.max_new_tokens,
            pad_token_id=pad_id if pad_id is not None else self.tokenizer.eos_token_id,
            eos_token_id=resolve_eos_token_id(model, self.tokenizer), do_sample=True,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed)
        return {**batch, **sampled}

    def dataset_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        student_logits = self.causal_lm_logits(self.student, batch)
        with torch.no_grad():
            teacher_logits = self.causal_lm_logits(self.teacher, batch)
        return generalized_jsd_loss(student_logits[:, :-1], teacher_logits[:, :-1], labels=batch["labels"][:, 1:],
                                    beta=self.beta, temperature=self.loss_temperature)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        source = self.choose_source(batch_idx)
        if source != "dataset":
            model = self.student if source == "student" else self.teacher
            batch = self.sample_batch(model, batch, seed=self.step_seed(batch_idx, _SAMPLE, self.global_rank))
        loss = self.dataset_loss(batch)
        if self.skip_nonfinite(loss):
            return None
        self.count_trained_tokens(batch["labels"])
        self._batches += 1
        self._on_policy_batches += source == "student"
        completion_tokens = (batch["labels"] != -100).sum(dim=1).float()
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/on_policy", float(source == "student"), batch_size=size)
        # the share of on-policy batches so far in this fit (train/on_policy is this batch's 0 or 1)
        self.log("train/on_policy_fraction", self._on_policy_batches / self._batches, prog_bar=True,
                 batch_size=size)
        self.log("train/completion_length", completion_tokens.mean(), batch_size=size)
        return loss


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}.")
