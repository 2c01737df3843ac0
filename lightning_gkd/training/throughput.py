"""Completion tokens trained per second of training step.

Lightning's ``ThroughputMonitor`` counts what the loader yields (``batch_size_fn``/``length_fn`` of the dataset
batch); an on-policy step trains on completions sampled inside the step, which the loader never sees, so the count
comes from the labels the loss actually used.
"""

from __future__ import annotations

import time

import torch

from lightning_gkd.ops.constants import IGNORE_INDEX


class TokenThroughput:
    """``start()`` at the start of a training batch, ``count(labels)`` with the labels it trains on, ``stop()`` at
    its end: returns ``(tokens, seconds)`` of the step (None when nothing was counted) and adds them to the totals
    of the current fit (``trained_tokens``, ``train_seconds``)."""

    def __init__(self) -> None:
        self.trained_tokens = 0
        self.train_seconds = 0.0
        self._tokens: torch.Tensor | None = None
        self._started: float | None = None

    def reset(self) -> None:
        self.trained_tokens, self.train_seconds = 0, 0.0

    def start(self) -> None:
        self._tokens, self._started = None, time.perf_counter()

    def count(self, labels: torch.Tensor) -> None:
        self._tokens = (labels != IGNORE_INDEX).sum()  # read (a host sync) only at stop()

    def stop(self) -> tuple[int, float] | None:
        if self._tokens is None or self._started is None:
            return None
        seconds = time.perf_counter() - self._started
        tokens = int(self._tokens)
        self.trained_tokens += tokens
        self.train_seconds += seconds
        return tokens, seconds

    def tokens_per_second(self) -> float:
        return self.trained_tokens / self.train_seconds if self.train_seconds else 0.0
