"""Samplers: how a method gets completions for a batch of prompts (on-policy from the student, or seq-KD from the
teacher). ``Sampler`` is the base class the methods call (``sample``, and an optional lifecycle that does nothing
there); ``KVCacheSampler`` (our KV-cache decoder, ``lightning_gkd.ops.decoding.sampling``) is the default engine;
``VLLMSampler`` runs vLLM engines in process (Hydra ``sampler=vllm``); ``SpeculativeKDSampler`` lets the teacher
correct the student's proposals (``sampler=skd``). Another engine subclasses ``Sampler`` and is passed as
``GKDModule(sampling={"sampler": ...})``. ``SamplingSettings``: the methods' ``sampling`` group."""

from lightning_gkd.samplers.base import Sampler, SamplerFactory, build_sampler, check_sampler, sampler_class
from lightning_gkd.samplers.kv_cache import KVCacheSampler
from lightning_gkd.samplers.settings import SamplingSettings
from lightning_gkd.samplers.skd import SpeculativeKDSampler
from lightning_gkd.samplers.vllm import VLLMSampler

__all__ = [
    "KVCacheSampler",
    "Sampler",
    "SamplerFactory",
    "SamplingSettings",
    "SpeculativeKDSampler",
    "VLLMSampler",
    "build_sampler",
    "check_sampler",
    "sampler_class",
]
