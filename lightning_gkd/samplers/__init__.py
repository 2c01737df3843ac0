"""Samplers: how a method gets completions for a batch of prompts (on-policy from the student, or seq-KD from the
teacher). ``Sampler`` is the protocol the methods call; ``KVCacheSampler`` (our KV-cache decoder,
``lightning_gkd.ops.decoding.sampling``) is the default engine; ``VLLMSampler`` runs vLLM engines in process (Hydra
``sampler=vllm``); ``SpeculativeKDSampler`` lets the teacher correct the student's proposals (``sampler=skd``).
Another engine implements the same ``sample`` and is passed as ``GKDModule(sampler=...)``."""

from lightning_gkd.samplers.base import (
    Sampler,
    SamplerFactory,
    build_sampler,
    check_sampler,
    sampled_logprobs_problem,
)
from lightning_gkd.samplers.kv_cache import KVCacheSampler
from lightning_gkd.samplers.skd import SpeculativeKDSampler
from lightning_gkd.samplers.vllm import VLLMSampler

__all__ = [
    "KVCacheSampler",
    "Sampler",
    "SamplerFactory",
    "SpeculativeKDSampler",
    "VLLMSampler",
    "build_sampler",
    "check_sampler",
    "sampled_logprobs_problem",
]
