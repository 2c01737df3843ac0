"""Asynchronous rollouts: a producer samples the trainer's upcoming batches with weights at most ``max_staleness``
optimizer steps old, overlapping sampling with training (docs/asynchronous.md)."""

from lightning_gkd.asynchronous.engines import EngineFactory, InProcessEngine, RolloutEngine, RolloutEngineUnavailable
from lightning_gkd.asynchronous.producer import Produced, RolloutProducer, StalenessLedger
from lightning_gkd.asynchronous.settings import AsyncSettings
from lightning_gkd.asynchronous.snapshot import WeightSnapshot
from lightning_gkd.asynchronous.vllm_process import VLLMProcessEngine

__all__ = [
    "AsyncSettings",
    "EngineFactory",
    "InProcessEngine",
    "Produced",
    "RolloutEngine",
    "RolloutEngineUnavailable",
    "RolloutProducer",
    "StalenessLedger",
    "VLLMProcessEngine",
    "WeightSnapshot",
]
