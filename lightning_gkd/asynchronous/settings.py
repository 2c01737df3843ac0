"""``AsyncSettings``: asynchronous rollouts (the on-policy methods' ``asynchronous`` group; Hydra
``method.asynchronous.*`` and the ``producer=`` group for its engine)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from lightning_gkd.asynchronous.engines import EngineFactory, RolloutEngine

__all__ = ["AsyncSettings"]


@dataclass(frozen=True)
class AsyncSettings:
    """Whether student samples come from a producer that runs ahead of the trainer, and how far.

    ``engine`` None (default): synchronous, each step samples its own batch with the live student. With an engine
    (a ``RolloutEngine``, or a factory of one called with the tokenizer and the sampling options; Hydra
    ``producer=hf|vllm``), a background producer samples each batch with the weights of at most ``max_staleness``
    optimizer steps before the step that trains on it, overlapping sampling with training (``max_staleness=0``:
    the same samples as the synchronous path, drawn by the engine)."""

    #: The most optimizer steps between the weights that draw a batch's samples and the weights they train (>= 0).
    max_staleness: int = 0
    #: The producer's engine; None: no producer (synchronous sampling).
    engine: RolloutEngine | EngineFactory | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ValueError(f"asynchronous.max_staleness must be an integer >= 0, got {self.max_staleness!r}.")
        if self.engine is None and self.max_staleness > 0:
            raise ValueError(
                f"asynchronous.max_staleness={self.max_staleness} needs an engine to sample ahead with: "
                "producer=vllm (a vLLM engine in its own process) or producer=hf (a copy of the student in this "
                "process); or max_staleness=0 for synchronous sampling."
            )
        if self.engine is not None and not (isinstance(self.engine, RolloutEngine) or callable(self.engine)):
            raise TypeError(
                f"asynchronous.engine must be a lightning_gkd.asynchronous.RolloutEngine or a factory of one, got "
                f"{self.engine!r}."
            )
        target = self.engine.func if isinstance(self.engine, partial) else self.engine
        check = getattr(target, "check_available", None)
        if callable(check):
            check()

    @property
    def enabled(self) -> bool:
        """Whether a producer samples ahead (an engine is set)."""
        return self.engine is not None

    def build(self, tokenizer: Any, **sampling_options: Any) -> RolloutEngine:
        """The engine: ``engine`` itself, or what its factory makes with ``tokenizer`` and the sampling options."""
        assert self.engine is not None
        built = self.engine if isinstance(self.engine, RolloutEngine) else self.engine(tokenizer, **sampling_options)
        if not isinstance(built, RolloutEngine):
            raise TypeError(f"asynchronous.engine made {built!r}, not a lightning_gkd.asynchronous.RolloutEngine.")
        return built
