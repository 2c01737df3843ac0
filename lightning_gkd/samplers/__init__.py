"""Samplers: how a method gets completions for a batch of prompts (on-policy from the student, or seq-KD from the
teacher). ``Sampler`` is the protocol the methods call; ``KVCacheSampler`` (our KV-cache decoder,
``lightning_gkd.ops.sampling``) is the default engine. Another engine (a serving engine, say) implements the same
``sample`` and is passed as ``GKDModule(sampler=...)``."""

from lightning_gkd.samplers.base import Sampler
from lightning_gkd.samplers.kv_cache import KVCacheSampler

__all__ = ["KVCacheSampler", "Sampler"]
