"""``RolloutProducer``: a thread that samples the trainer's upcoming batches ahead of their steps, in the order it
was given them, each with the weights version that was current when it was given (one FIFO of weight snapshots and
sampling jobs), so a run's samples are a function of the seed and the bound alone, never of timing.

With ``max_staleness = k`` the trainer gives the producer batch ``j`` when it starts the step ``k`` optimizer
steps before ``j``'s (``data.loader.UPCOMING``), with that step's weights: batch ``j`` trains on samples at most
``k`` optimizer steps old, and its sampling overlaps the ``k`` steps in between. The trainer then only waits for a
sample that is not ready yet (``trainer_idle_seconds``); the producer only waits for work (``producer_idle_seconds``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lightning_gkd.asynchronous.engines import RolloutEngine
from lightning_gkd.asynchronous.snapshot import WeightSnapshot

__all__ = ["Produced", "RolloutProducer", "StalenessLedger"]

#: ``produce(engine, batch, seed) -> (sampled batch, figures to log)``: one job's sampling (a single completion per
#: prompt, or a whole multi-turn rollout whose turns call ``engine.sample``).
ProduceFn = Callable[[RolloutEngine, dict[str, Any], int], tuple[dict[str, Any], dict[str, float]]]


@dataclass(frozen=True)
class Produced:
    """A sampled batch, the weights version that drew it, the seconds its sampling took and its figures."""

    batch: dict[str, Any]
    version: int
    seconds: float
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class StalenessLedger:
    """What the trainer did with the producer's samples: how stale each trained batch was (optimizer steps between
    the weights that drew it and the weights it trains), how many were dropped for exceeding ``max_staleness``,
    and the seconds it waited for samples and spent taking weight snapshots."""

    max_staleness: int
    staleness: Counter[int] = field(default_factory=Counter)
    dropped: int = 0
    trainer_idle_seconds: float = 0.0
    snapshot_seconds: float = 0.0

    def accept(self, produced: Produced, version: int) -> bool:
        """Whether samples drawn at ``produced.version`` may train the weights of ``version``; counts them."""
        age = version - produced.version
        if age > self.max_staleness:
            self.dropped += 1
            return False
        self.staleness[age] += 1
        return True

    def figures(self) -> dict[str, float]:
        """Totals so far: ``staleness/<k>`` (trained batches of each staleness), ``staleness_mean``, ``dropped``,
        ``trainer_idle_seconds``, ``snapshot_seconds``."""
        trained = sum(self.staleness.values())
        out = {f"staleness/{age}": float(self.staleness[age]) for age in range(self.max_staleness + 1)}
        out["staleness_mean"] = sum(age * n for age, n in self.staleness.items()) / trained if trained else 0.0
        out.update(
            dropped=float(self.dropped),
            trainer_idle_seconds=self.trainer_idle_seconds,
            snapshot_seconds=self.snapshot_seconds,
        )
        return out


class RolloutProducer:
    """Runs ``produce`` for each submitted job on ``engine`` in a background thread, in submission order, with the
    weights of the snapshots published before the job (``publish``).

    ``submit(key, batch, seed)`` returns at once; ``collect(key)`` waits for that job's ``Produced``. An error in a
    job is raised by its ``collect``; a ``RolloutEngineUnavailable`` (the engine's process died) by every later one
    too. ``close()`` stops the thread and the engine."""

    def __init__(self, engine: RolloutEngine, produce: ProduceFn) -> None:
        self.engine, self.produce = engine, produce
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._futures: dict[Any, Future[Produced]] = {}
        self.version = -1  # the engine's weights version (producer thread)
        self.producer_idle_seconds = 0.0
        self.weight_load_seconds = 0.0
        self.weight_loads = 0
        self.sample_seconds = 0.0
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lightning_gkd_rollout_producer", daemon=True)
        self._thread.start()

    # -- the trainer's side ---------------------------------------------------------------------------------------
    def publish(self, snapshot: WeightSnapshot) -> None:
        """Jobs submitted from now on sample with ``snapshot``'s weights."""
        self._jobs.put(("weights", snapshot))

    def submit(self, key: Any, batch: dict[str, Any], seed: int) -> None:
        """Queue ``batch``'s sampling (``key``: how ``collect`` finds it)."""
        if key in self._futures:
            raise ValueError(f"A rollout job {key!r} is already queued.")
        future: Future[Produced] = Future()
        self._futures[key] = future
        self._jobs.put(("job", (future, batch, seed)))

    def submitted(self, key: Any) -> bool:
        return key in self._futures

    def collect(self, key: Any) -> tuple[Produced, float]:
        """The job's samples and the seconds the caller waited for them."""
        future = self._futures.pop(key)
        started = time.perf_counter()
        produced = future.result()
        return produced, time.perf_counter() - started

    def discard(self) -> None:
        """Forget the jobs not collected yet (their results are thrown away when they finish)."""
        self._futures.clear()

    def figures(self) -> dict[str, float]:
        """The producer's totals: ``producer_idle_seconds``, ``weight_load_seconds``, ``weight_loads``,
        ``sample_seconds``."""
        return {
            "producer_idle_seconds": self.producer_idle_seconds,
            "weight_load_seconds": self.weight_load_seconds,
            "weight_loads": float(self.weight_loads),
            "sample_seconds": self.sample_seconds,
        }

    def close(self) -> None:
        """Stop the thread after the job it is running, then the engine."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._futures.clear()
        self.engine.close()

    # -- the producer's thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            waited = time.perf_counter()
            item = self._jobs.get()
            self.producer_idle_seconds += time.perf_counter() - waited
            if item is None:
                return
            kind, payload = item
            if kind == "weights":
                if self._failure is None:
                    try:
                        self.weight_load_seconds += self.engine.load_weights(payload)
                        self.weight_loads += 1
                        self.version = payload.version
                    except BaseException as error:  # the engine is gone: every later job fails with it
                        self._failure = error
                continue
            future, batch, seed = payload
            if self._failure is not None:
                future.set_exception(self._failure)
                continue
            started = time.perf_counter()
            try:
                sampled, figures = self.produce(self.engine, batch, seed)
            except BaseException as error:
                future.set_exception(error)
                continue
            seconds = time.perf_counter() - started
            self.sample_seconds += seconds
            future.set_result(Produced(sampled, self.version, seconds, figures))
