"""Speculative knowledge distillation's sampler (Hydra ``sampler=skd``): the student proposes, the teacher keeps a
proposal among its top-``accept_top_k`` or replaces it with its own draw (``ops.decoding.speculative``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.decoding.sampling import generate_completions, validate_sampling_args
from lightning_gkd.ops.decoding.speculative import check_speculative_settings, speculative_completions
from lightning_gkd.ops.hf.forward import (
    check_matmul_precision,
    float32_matmul_precision,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.hf.model_inputs import VisionRows
from lightning_gkd.samplers.base import Sampler

_TEACHER_NEEDED = (
    "sampler=skd verifies the student's drafts with one in-process teacher model, got {kinds}. Use teacher=local, "
    "or another sampler (sampler=hf or sampler=vllm) with this teacher."
)


@dataclass
class SpeculativeKDSampler(Sampler):
    """Interleaved sampling for on-policy distillation (SKD, Xu et al., 2024): the student drafts ``draft_tokens``
    tokens with its KV cache, one teacher forward verifies them, each draft the teacher ranks among its
    ``accept_top_k`` most likely tokens is kept, and the first rejected one is replaced by a draw from the teacher (the
    rest is drafted again). ``accept_top_k`` at least the vocabulary size is plain student sampling; 1 keeps only the
    teacher's top-1. Both models sample with the method's ``temperature``, ``top_k`` and ``top_p``.

    The teacher is the method's in-process teacher (``bind_teachers``); a served or cached teacher cannot score the
    student's drafts one block at a time here. Samples of the teacher itself (``seq_kd``) are plain teacher samples.
    ``last_stats()`` reports the last call's ``replacement_rate`` (replaced tokens / sampled tokens),
    ``teacher_tokens_per_token`` and ``student_tokens_per_token`` (positions each model ran over, prompts included,
    per sampled token: the verification's cost) and ``tokens_per_block``. Deterministic for a seed.
    ``matmul_precision``: as ``KVCacheSampler``'s."""

    tokenizer: Any
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    accept_top_k: int = 25
    draft_tokens: int = 2
    matmul_precision: str | None = "medium"
    teacher: nn.Module | None = field(default=None, repr=False)
    _stats: dict[str, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        validate_sampling_args(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        check_matmul_precision(self.matmul_precision)
        check_speculative_settings(self.accept_top_k, self.draft_tokens)

    @staticmethod
    def check_settings(accept_top_k: int = 25, draft_tokens: int = 2, **_: Any) -> None:
        """The factory's options, before any model loads."""
        check_speculative_settings(accept_top_k, draft_tokens)

    @staticmethod
    def check_teachers(plan: Any) -> None:
        """One in-process teacher (a model, ``teacher=local``) in the method's ``TeacherPlan``, before any model
        loads."""
        entries = plan.entries
        if len(entries) != 1 or next(iter(entries.values())).kind != "local":
            kinds = ", ".join(f"{name or 'teacher'}: {entry.kind}" for name, entry in entries.items())
            raise ValueError(_TEACHER_NEEDED.format(kinds=kinds))

    def bind_teachers(self, sources: Mapping[str, Any]) -> None:
        """Take the method's teacher: the in-process model of its only teacher. ValueError for anything else."""
        model = getattr(sources.get(""), "model", None) if len(sources) == 1 else None
        if not isinstance(model, nn.Module):
            kinds = ", ".join(f"{name or 'teacher'}: {type(source).__name__}" for name, source in sources.items())
            raise ValueError(_TEACHER_NEEDED.format(kinds=kinds))
        self.teacher = model

    def sample(
        self,
        model: nn.Module,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        seed: int,
        vision: VisionRows | None = None,
    ) -> dict[str, torch.Tensor]:
        self.refuse_images(vision)
        if self.teacher is None:
            raise RuntimeError(
                "SpeculativeKDSampler has no teacher: a method binds it (bind_teachers); outside one, set "
                "sampler.teacher to the teacher model."
            )
        options: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "pad_token_id": resolve_pad_token_id(self.tokenizer),
            "eos_token_id": resolve_eos_token_id(model, self.tokenizer),
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": seed,
        }
        self._stats = {}
        with float32_matmul_precision(self.matmul_precision):
            if model is self.teacher:  # seq_kd: the teacher's own samples need no verification
                return generate_completions(model, prompts, prompt_attention_mask, do_sample=True, **options)
            batch, sample = speculative_completions(
                model,
                self.teacher,
                prompts,
                prompt_attention_mask,
                accept_top_k=self.accept_top_k,
                draft_tokens=self.draft_tokens,
                **options,
            )
        sampled = max(int((batch["labels"] != -100).sum()), 1)
        self._stats = {
            "replacement_rate": float(sample.replaced.sum()) / sampled,
            "teacher_tokens_per_token": sample.teacher_tokens / sampled,
            "student_tokens_per_token": sample.student_tokens / sampled,
            "tokens_per_block": sample.tokens.shape[1] / max(sample.blocks, 1),
        }
        return batch

    def last_stats(self) -> dict[str, float]:
        """The last ``sample`` call's figures (class docstring); empty before the first or after teacher samples."""
        return dict(self._stats)
