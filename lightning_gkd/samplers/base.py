"""The sampler base class, and how a method builds its sampler from a factory (Hydra ``sampler=hf|vllm|skd``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_gkd.ops.hf.model_inputs import VisionRows, has_images


class Sampler(ABC):
    """Samples one completion per prompt with ``model``; a method calls ``sample`` once per generation group.

    Everything else a method calls is optional for a sampler and does nothing here: an engine with its own copy of
    the weights (``VLLMSampler``) overrides ``start(models, *, max_model_len)`` (when fitting starts; role → model),
    ``weights_updated()`` (before every optimizer step), ``close()`` (at teardown) and ``greedy(model, prompts,
    prompt_attention_mask, *, max_new_tokens)`` (validation's greedy completions, same output contract as
    ``sample``; None here: the caller decodes in process with our KV-cache decoder). A sampler that reads the teacher
    overrides ``bind_teachers(sources)`` (the method's teachers by name, once they are built); one that reports
    figures ``last_stats()`` (name → float of its last call, logged as ``train/sampler/<name>``); one whose
    ``sampled_logprobs`` may not be those of the distribution it sampled from (a served engine's raw log-probs)
    ``sampled_logprobs_problem()`` (None when they are, else why not); one that keeps state across the turns of a
    multi-turn rollout (``KVCacheSampler``'s KV) ``end_rollout()`` (after each rollout: release it).

    Before any model loads, the class's static checks run on a sampler, its class or a ``functools.partial`` of it
    (``check_sampler``, ``SamplingSettings.check_teachers``): ``check_available()`` (its 'not installed' error),
    ``check_settings(**options)`` (a factory's options) and ``check_teachers(plan)`` (the method's
    ``TeacherPlan``); each accepts anything here.
    """

    #: whether ``sample`` takes prompts with images (``vision``); a method refuses image rows with one that does not
    takes_images: ClassVar[bool] = False

    @abstractmethod
    def sample(
        self,
        model: nn.Module,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        seed: int,
        vision: VisionRows | None = None,
    ) -> dict[str, Any]:
        """Completions for left-padded ``prompts`` ``(B, P)``, reproducible for a given ``seed``; ``vision``: the
        prompts' image inputs, one dict per row (``ops.hf.model_inputs``), taken where ``takes_images``.

        Returns the training batch of ``lightning_gkd.ops.decoding.sampling.completion_batch``: ``input_ids``,
        ``attention_mask`` and ``labels``, each ``(B, P + N)``: the prompt columns as given (labels -100), then the
        completion up to and including its first EOS (attention 0 and labels -100 after it); and
        ``sampled_logprobs`` ``(B, P + N)``: each completion token's log-probability under the distribution it was
        sampled from (temperature, top-k, top-p applied), 0 where labels are -100; and ``vision`` as given.
        """

    def refuse_images(self, vision: VisionRows | None) -> None:
        """ValueError when prompts hold images and this sampler does not take them."""
        if has_images(vision) and not self.takes_images:
            raise ValueError(refuse_images_message(type(self)))

    # -- checks before any model loads ----------------------------------------------------------------------------
    @staticmethod
    def check_available() -> None:
        """Raise ImportError naming the install command when the engine's package is missing."""

    @staticmethod
    def check_settings(**options: Any) -> None:
        """Raise ValueError for a factory's options (``functools.partial`` keywords) the sampler would refuse."""

    @staticmethod
    def check_teachers(plan: Any, **options: Any) -> None:
        """Raise ValueError for teachers (the method's ``TeacherPlan``) this sampler cannot work with, given the
        factory's ``options`` (``functools.partial`` keywords)."""

    # -- the lifecycle a method drives ------------------------------------------------------------------------------
    def bind_teachers(self, sources: Mapping[str, Any]) -> None:
        """Take the method's teacher sources by name, once they are built."""

    def start(self, models: Mapping[str, nn.Module], *, max_model_len: int | None = None) -> None:
        """Start serving ``models`` (role → model) for sequences of up to ``max_model_len`` tokens."""

    def weights_updated(self) -> None:
        """An optimizer step is about to change the trainable models."""

    def close(self) -> None:
        """Release what the sampler holds (engines); it may start again on its next use."""

    def end_rollout(self) -> None:
        """A multi-turn rollout ended: release what was kept for its turns."""

    def greedy(
        self, model: nn.Module, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int
    ) -> dict[str, torch.Tensor] | None:
        """Greedy completions through the sampler's engine, or None: no engine, decode in process."""
        return None

    def last_stats(self) -> dict[str, float]:
        """Figures of the last ``sample`` call, by name."""
        return {}

    def sampled_logprobs_problem(self) -> str | None:
        """Why ``sampled_logprobs`` are not the log-probs of the distribution sampled from, or None when they are."""
        return None


#: A callable that makes a sampler: ``factory(tokenizer, max_new_tokens=, temperature=, top_k=, top_p=)`` (a
#: ``Sampler`` class such as ``KVCacheSampler``, or ``functools.partial(VLLMSampler, sync_every=2)``; Hydra:
#: ``_partial_: true``).
SamplerFactory = Callable[..., Sampler]


def sampler_class(sampler: Sampler | SamplerFactory) -> type[Sampler] | None:
    """The ``Sampler`` class of a sampler, of a ``Sampler`` class or of a ``functools.partial`` of one; None for
    another factory (its sampler's class is known once it is built)."""
    if isinstance(sampler, Sampler):
        return type(sampler)
    target = sampler.func if isinstance(sampler, partial) else sampler
    return target if isinstance(target, type) and issubclass(target, Sampler) else None


def check_sampler(sampler: Sampler | SamplerFactory) -> None:
    """A sampler's own checks before any model loads (see ``Sampler``): installed, and a factory's options. (Its
    check of the teachers runs once they are planned: ``SamplingSettings.check_teachers``.)"""
    cls = sampler_class(sampler)
    if cls is not None:
        cls.check_available()
        cls.check_settings(**(sampler.keywords if isinstance(sampler, partial) else {}))


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
    and sampling options. TypeError when the result is not a ``Sampler``."""
    built = sampler
    if not isinstance(sampler, Sampler):
        built = sampler(tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    if not isinstance(built, Sampler):
        raise TypeError(
            f"The sampler must be a lightning_gkd.samplers.Sampler (or a factory of one), got {built!r}: subclass "
            "Sampler and implement sample(model, prompts, prompt_attention_mask, *, seed); its other hooks are "
            "optional."
        )
    return built


def refuse_images_message(cls: type[Sampler]) -> str:
    return (
        f"{cls.__name__} does not sample from prompts with images; use the KV-cache sampler (Hydra: sampler=hf), "
        "which prefills with the images, for a vision-language student."
    )


def check_sampler_images(sampler: Sampler | SamplerFactory) -> None:
    """ValueError, before any model loads, when the data holds images and ``sampler``'s class does not take them."""
    cls = sampler_class(sampler)
    if cls is not None and not cls.takes_images:
        raise ValueError(refuse_images_message(cls))
