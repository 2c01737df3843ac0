"""Starting multi-process tests: a free port and an environment in which Lightning starts the other ranks itself."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: seconds a multi-process test waits for its workers
TIMEOUT = 180

#: what a launcher (SLURM, torchrun, an outer Lightning run) sets; with any of it Lightning would not start rank 1
LAUNCHER_PREFIXES = (
    "SLURM_",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "MASTER_",
    "RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (Lightning then starts rank 1 itself), one thread per
    process, the repository importable, and a free port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def two_process_trainer(out: Path, kind: str, max_steps: int, *, timeout_s: float | None = None, **kwargs: object):
    """The tests' ``small_trainer`` on 2 CPU processes (gloo) under DDP (``kind`` "ddp") or FSDP2 ("fsdp":
    ``ModelParallelStrategy``), no validation, logging, checkpoints or bars: the workers' fits. ``timeout_s``: the
    process group's timeout (a collective one rank never joins fails after it; default Lightning's 30 minutes)."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from helpers.fitting import small_trainer

    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **timeout)
        if kind == "fsdp"
        else DDPStrategy(**timeout)
    )
    return small_trainer(out, devices=2, strategy=strategy, max_steps=max_steps, **kwargs)
