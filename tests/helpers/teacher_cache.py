"""What the tests of the offline teacher (tests/teachers/offline/) share: the toy teacher, the trainer of the
single-process builds, the toy teacher's sizes, and helpers (tests/teachers/offline/conftest.py: the built caches)."""

from __future__ import annotations

import copy
import random
from contextlib import contextmanager

import lightning as L
import torch

from lightning_gkd.toy.tiny import asset_path

TEACHER = asset_path("toy/teacher")
TRAINER = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}
HIDDEN_SIZE, VOCAB = 128, 259  # the toy teacher's


@contextmanager
def one_thread():
    """The 2-process build runs one thread per process: the reference does too (same kernels, same bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def batches(rows, sizes, seed):
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    start = 0
    for size in sizes:
        yield [rows[i] for i in order[start : start + size]]
        start += size


def scaled_teacher(teacher, factor: float):
    """The toy teacher with its final norm scaled by ``factor``: hidden states ``factor`` times larger, its head
    still exactly the projection of them."""
    scaled = copy.deepcopy(teacher)
    with torch.no_grad():
        scaled.model.norm.weight.mul_(factor)
    return scaled


def predict_trainer(callbacks: list[L.Callback] | None = None) -> L.Trainer:
    """A one-process CPU trainer for a build's predict loop (as ``lightning-gkd-cache`` makes it: no logger,
    checkpoints or distributed sampler), with ``callbacks``."""
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks or [],
    )
