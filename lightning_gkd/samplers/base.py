"""The sampler protocol, and how a method builds its sampler from a factory (Hydra ``sampler=hf|vllm|skd``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Sampler(Protocol):
    """Samples one completion per prompt with ``model``; a method calls it once per generation group.

    A sampler backed by an engine with its own copy of the weights may also have (the method calls each one when
    present): ``start(models, *, max_model_len)`` when fitting starts (role → model), ``weights_updated()`` before
    every optimizer step, ``close()`` at teardown, and ``greedy(model, prompts, prompt_attention_mask, *,
    max_new_tokens)`` for validation generations (same output contract as ``sample``). A sampler that reads the
    teacher has ``bind_teachers(sources)`` (the method's teachers by name, once they are built); one that reports
    figures has ``last_stats()`` (name → float of its last call, logged as ``train/sampler/<name>``). One whose
    ``sampled_logprobs`` may not be those of the distribution it sampled from (a served engine's raw log-probs) has
    ``sampled_logprobs_problem()``: None when they are, else why not (``sampled_logprobs_problem`` below).
    """

    def sample(
        self, model: nn.Module, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int
    ) -> dict[str, torch.Tensor]:
        """Completions for left-padded ``prompts`` ``(B, P)``, reproducible for a given ``seed``.

        Returns the training batch of ``lightning_gkd.ops.decoding.sampling.completion_batch``: ``input_ids``,
        ``attention_mask`` and ``labels``, each ``(B, P + N)``: the prompt columns as given (labels -100), then the
        completion up to and including its first EOS (attention 0 and labels -100 after it); and
        ``sampled_logprobs`` ``(B, P + N)``: each completion token's log-probability under the distribution it was
        sampled from (temperature, top-k, top-p applied), 0 where labels are -100.
        """
        ...


#: A callable that makes a sampler: ``factory(tokenizer, max_new_tokens=, temperature=, top_k=, top_p=)`` (a class
#: such as ``KVCacheSampler``, or ``functools.partial(VLLMSampler, sync_every=2)``; Hydra: ``_partial_: true``).
SamplerFactory = Callable[..., Sampler]


def build_sampler(
    sampler: Sampler | SamplerFactory,
    tokenizer: Any,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
) -> Sampler:
    """``sampler`` itself when it already samples, else the sampler its factory makes with the method's tokenizer
    and sampling options."""
    if isinstance(sampler, Sampler) and not isinstance(sampler, type):
        return sampler
    return sampler(tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)


def check_sampler(sampler: Any, teachers: Any = None) -> None:
    """A sampler's own checks before any model loads, where its class has them: ``check_available()`` (its 'not
    installed' error), ``check_settings(**options)`` (a factory's options) and ``check_teachers(plan)`` (a sampler
    that reads the teacher: ``teachers``, the method's ``TeacherPlan``)."""
    target = getattr(sampler, "func", sampler)  # a functools.partial's class
    check = getattr(target, "check_available", None)
    if callable(check):
        check()
    check_settings = getattr(target, "check_settings", None)
    if callable(check_settings):
        check_settings(**dict(getattr(sampler, "keywords", {})))
    check_teachers = getattr(target, "check_teachers", None)
    if callable(check_teachers) and teachers is not None:
        check_teachers(teachers)


def sampled_logprobs_problem(sampler: Any) -> str | None:
    """Why ``sampler``'s ``sampled_logprobs`` are not the log-probs of the distribution it sampled from, or None
    when they are (every in-process sampler and ``VLLMSampler``; a served sampler answers for its server)."""
    problem = getattr(sampler, "sampled_logprobs_problem", None)
    return problem() if callable(problem) else None
