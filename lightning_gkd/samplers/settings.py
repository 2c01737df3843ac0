"""``SamplingSettings``: how the on-policy methods sample (GKD's and OPD's ``sampling`` group; Hydra
``method.sampling.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from lightning_gkd.ops.decoding.sampling import validate_sampling_args
from lightning_gkd.samplers.base import Sampler, SamplerFactory, build_sampler, check_sampler, sampler_class
from lightning_gkd.samplers.kv_cache import KVCacheSampler


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling options and the engine that samples with them. The defaults are TRL's ``GKDConfig``'s (OPD
    samples at ``temperature=1.0``: ``OPDModule.default_sampling``).

    Checked when made, before any model loads: the ranges, and the sampler's own checks (installed, a factory's
    options: ``samplers.base.check_sampler``)."""

    #: Softmax temperature of the samples (> 0; 1: the model's own distribution).
    temperature: float = 0.9
    #: Sample among the ``top_k`` most likely tokens only (0: off).
    top_k: int = 0
    #: Nucleus sampling: the smallest set of tokens holding ``top_p`` of the mass (1: off).
    top_p: float = 1.0
    #: The longest sample, in new tokens (>= 1).
    max_new_tokens: int = 128
    #: The engine: a ``Sampler``, or a factory called with the tokenizer and the four options above (a ``Sampler``
    #: class, a ``functools.partial`` of one; Hydra ``sampler=hf|vllm|skd``). None: ``KVCacheSampler``, our
    #: KV-cache decoder.
    sampler: Sampler | SamplerFactory | None = None

    def __post_init__(self) -> None:
        validate_sampling_args(self.max_new_tokens, self.temperature, self.top_k, self.top_p, where="sampling.")
        if self.sampler is not None and not (isinstance(self.sampler, Sampler) or callable(self.sampler)):
            raise TypeError(
                f"sampling.sampler must be a lightning_gkd.samplers.Sampler or a factory of one (a Sampler class, "
                f"a functools.partial; Hydra: sampler=hf|vllm|skd), or None for KVCacheSampler, got {self.sampler!r}."
            )
        check_sampler(self.engine)

    @property
    def engine(self) -> Sampler | SamplerFactory:
        """``sampler``, or ``KVCacheSampler`` when it is None."""
        return KVCacheSampler if self.sampler is None else self.sampler

    def options(self) -> dict[str, Any]:
        """The options a sampler factory is called with."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
        }

    def check_teachers(self, plan: Any) -> None:
        """The sampler's check of the method's teachers (``TeacherPlan``) before any model loads, with the factory's
        options (speculative KD: a teacher that can verify drafts; a served one's ``top_k`` at least
        ``accept_top_k``)."""
        cls = sampler_class(self.engine)
        if cls is not None:
            cls.check_teachers(plan, **(self.engine.keywords if isinstance(self.engine, partial) else {}))

    def build(self, tokenizer: Any) -> Sampler:
        """The sampler: ``sampler`` itself, or what its factory makes with ``tokenizer`` and ``options()``."""
        return build_sampler(self.engine, tokenizer, **self.options())
