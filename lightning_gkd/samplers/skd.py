"""Speculative knowledge distillation's sampler (Hydra ``sampler=skd``): the student proposes, the teacher keeps a
proposal among its top-``accept_top_k`` or replaces it with its own draw (``ops.decoding.speculative``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.decoding.sampling import generate_completions, validate_sampling_args
from lightning_gkd.ops.decoding.speculative import (
    BlockVerifier,
    ModelVerifier,
    check_speculative_settings,
    check_verifiable,
    speculative_completions,
)
from lightning_gkd.ops.hf.forward import (
    check_matmul_precision,
    float32_matmul_precision,
    resolve_eos_token_id,
    resolve_pad_token_id,
)
from lightning_gkd.ops.hf.model_inputs import VisionRows
from lightning_gkd.samplers.base import Sampler

_TEACHER_NEEDED = (
    "sampler=skd verifies the student's drafts with one teacher that can score them block by block: an in-process "
    "model (teacher=local) or a top-k server (teacher=server with signal=topk), got {kinds}. Use one of those, or "
    "another sampler (sampler=hf or sampler=vllm) with this teacher."
)


def _kind(entry: Any) -> str:
    signal = entry.settings.get("signal") if entry.kind == "server" else None
    return f"{entry.kind} (signal={signal})" if signal else str(entry.kind)


@dataclass
class SpeculativeKDSampler(Sampler):
    """Interleaved sampling for on-policy distillation (SKD, Xu et al., 2024): the student drafts ``draft_tokens``
    tokens with its KV cache, the teacher verifies them in one pass, each draft the teacher ranks among its
    ``accept_top_k`` most likely tokens is kept, and the first rejected one is replaced by a draw from the teacher (the
    rest is drafted again). ``accept_top_k`` at least the vocabulary size is plain student sampling; 1 keeps only the
    teacher's top-1. Both models sample with the method's ``temperature``, ``top_k`` and ``top_p``.

    The teacher verifies through a ``BlockVerifier`` (``ops.decoding.speculative``) that ``bind_teachers`` takes from
    the method's only teacher source (``block_verifier(accept_top_k)``): the in-process model (``teacher=local``:
    ``ModelVerifier``, exact) or a vLLM top-k server (``teacher=server``: ``teachers.server.ServerBlockVerifier``,
    one request per row and block; ``accept_top_k`` must be <= its ``top_k``; the replacement is drawn from the
    teacher's top-k renormalised, exact when the sampling ``top_k`` is between 1 and the server's ``top_k``). A
    cached teacher cannot score new drafts. Outside a method, set ``teacher`` (a model) or ``verifier`` (a callable
    returning a fresh ``BlockVerifier``). Samples of the teacher itself (``seq_kd``) are plain teacher samples.
    ``last_stats()`` reports the last call's ``replacement_rate`` (replaced tokens / sampled tokens),
    ``teacher_tokens_per_token`` and ``student_tokens_per_token`` (positions each model ran over, or tokens sent to
    a server, prompts included, per sampled token: the verification's cost) and ``tokens_per_block``. Deterministic
    for a seed. ``matmul_precision``: as ``KVCacheSampler``'s."""

    tokenizer: Any
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    accept_top_k: int = 25
    draft_tokens: int = 2
    matmul_precision: str | None = "medium"
    teacher: nn.Module | None = field(default=None, repr=False)
    verifier: Callable[[], BlockVerifier] | None = field(default=None, repr=False)
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
    def check_teachers(plan: Any, accept_top_k: int | None = None, **_: Any) -> None:
        """One teacher that can verify drafts in the method's ``TeacherPlan``, before any model loads: an in-process
        model (``teacher=local``), a top-k server (``teacher=server``, ``signal=topk``) whose ``top_k`` is at least
        ``accept_top_k`` (when given: the factory's option), or a built teacher object with ``block_verifier``."""
        entries = plan.entries
        entry = next(iter(entries.values())) if len(entries) == 1 else None
        verifiable = entry is not None and (
            entry.kind == "local"
            or entry.kind == "server"
            and (entry.settings.get("signal") or "topk") == "topk"
            or entry.kind == "object"
            and callable(getattr(entry.built, "block_verifier", None))
        )
        if not verifiable:
            kinds = ", ".join(f"{name or 'teacher'}: {_kind(e)}" for name, e in entries.items())
            raise ValueError(_TEACHER_NEEDED.format(kinds=kinds))
        if entry is not None and entry.kind == "server" and accept_top_k is not None:
            check_verifiable(accept_top_k, entry.settings.get("top_k"), str(entry.settings.get("url")))

    def bind_teachers(self, sources: Mapping[str, Any]) -> None:
        """Take the method's only teacher source and its ``block_verifier`` (ValueError for anything else, or for an
        ``accept_top_k`` the source cannot verify: a server's ``top_k`` below it)."""
        source = sources.get("") if len(sources) == 1 else None
        make = getattr(source, "block_verifier", None)
        if not callable(make):
            kinds = ", ".join(f"{name or 'teacher'}: {type(s).__name__}" for name, s in sources.items())
            raise ValueError(_TEACHER_NEEDED.format(kinds=kinds))
        make(self.accept_top_k)  # its checks, now: no request, no forward
        self.verifier = partial(make, self.accept_top_k)
        model = getattr(source, "model", None)
        self.teacher = model if isinstance(model, nn.Module) else None

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
        make = self.verifier
        if make is None and self.teacher is not None:
            make = partial(ModelVerifier, self.teacher)
        if make is None:
            raise RuntimeError(
                "SpeculativeKDSampler has no teacher: a method binds it (bind_teachers); outside one, set "
                "sampler.teacher to the teacher model (or sampler.verifier to a BlockVerifier factory)."
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
                make(),
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
