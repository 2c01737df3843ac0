"""The one resumable, sharded predict loop of the offline teacher: the teacher cache's Arrow shards
(``teachers.offline.build``) and its SeqKD completions' parts (``teachers.offline.completions``) are written by it.

The rows ``[0, num_rows)`` are cut into shards of ``shard_size`` consecutive rows, one file each.
``ShardedWriter.predict(trainer, module)`` runs ``trainer.predict`` over the rows of the shards whose file is
missing: rank 0 lists them (and calls ``before_writing`` with them), then broadcasts the list, so no rank writes
before every rank has it; they are dealt to the ranks round-robin (a fresh run: shard ``s`` to rank
``s % world_size``), whole shards per rank, through each rank's own loader (no ``DistributedSampler``, which would
pad with duplicated rows). A rank's batches never cross a shard, so a shard's bytes do not depend on the rank, the
world size or an earlier interrupted run. The predicted rows are collected per shard, and a shard whose rows are all
there is written in row order, to ``<name>.tmp``, flushed to disk and renamed into place (``write_atomically``): a
kill leaves whole files (and perhaps a ``.tmp``), and the same command again writes only the missing ones.

A use subclasses ``ShardedWriter`` and says what its files are: ``shard_name``, ``predicted_rows`` (a prediction's
rows with their indices) and ``write_records`` (a shard's records into a file); the loader's batches are ``collate``
of the rows of each batch (``make_batch``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, IterableDataset

from lightning_gkd.teachers.offline.atomic import write_atomically


class Rows(Protocol):
    """Rows by index: a list, a ``datasets.Dataset``, a ``RowDataset``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def count_shards(num_rows: int, shard_size: int) -> int:
    return -(-num_rows // shard_size)


def shard_rows(shard: int, num_rows: int, shard_size: int) -> range:
    """The rows that shard ``shard`` holds."""
    return range(shard * shard_size, min((shard + 1) * shard_size, num_rows))


def shard_batches(shards: Sequence[int], num_rows: int, shard_size: int, batch_size: int) -> list[range]:
    """The row indices of each batch of ``shards``, in order: ``batch_size`` rows a batch, none crossing a shard."""
    batches = []
    for shard in shards:
        indices = shard_rows(shard, num_rows, shard_size)
        batches += [indices[start : start + batch_size] for start in range(0, len(indices), batch_size)]
    return batches


class ShardedWriter(BasePredictionWriter):
    """Writes the files of the shards of ``rows`` (``shard_size`` rows a shard) into ``folder`` from the predictions
    of a predict loop over the rows of those still missing, in batches of ``batch_size`` rows collated by ``collate``
    (the module docstring); ``predict`` runs it. ``what``: the files, for errors ("Teacher cache shards").

    After ``predict``: ``pending``, the shards this run wrote over all ranks; ``started``, when the loop's loaders
    were set up (the model loaded)."""

    what = "Shards"

    def __init__(
        self,
        folder: Path,
        rows: Rows,
        collate: Callable[[list[Any]], Any],
        *,
        shard_size: int,
        batch_size: int,
    ) -> None:
        super().__init__(write_interval="batch")
        self.folder, self.rows, self.collate = folder, rows, collate
        self.num_rows, self.shard_size, self.batch_size = len(rows), shard_size, batch_size
        self.pending: list[int] = []  # the shards this run writes, over all ranks
        self.shards: list[int] = []  # this rank's
        self.buffers: dict[int, dict[int, Any]] = {}  # shard -> row index -> record
        self.started = time.perf_counter()

    # -- what a use says ----------------------------------------------------------------------------------------------
    def shard_name(self, shard: int) -> str:
        """The file name of shard ``shard``."""
        raise NotImplementedError

    def predicted_rows(self, prediction: Any) -> Iterable[tuple[int, Any]]:
        """Each row of a batch's ``prediction``: its index, and its record as ``write_records`` takes it."""
        raise NotImplementedError

    def write_records(self, path: Path, records: list[Any]) -> None:
        """Write one shard's ``records`` (in row order) to ``path``."""
        raise NotImplementedError

    def before_writing(self, pending: list[int]) -> None:
        """Rank 0, when some shards are missing (``pending``), before any of them is written."""

    def make_batch(self, indices: range) -> Any:
        """The loader's batch of the rows ``indices`` (consecutive, within one shard)."""
        return self.collate([self.rows[index] for index in indices])

    # -- the loop -----------------------------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return count_shards(self.num_rows, self.shard_size)

    def path(self, shard: int) -> Path:
        return self.folder / self.shard_name(shard)

    def missing(self) -> list[int]:
        """The shards whose file is not (yet) in ``folder``."""
        return [shard for shard in range(self.num_shards) if not self.path(shard).is_file()]

    def predict(self, trainer: L.Trainer, module: L.LightningModule) -> list[int]:
        """Run ``module``'s ``predict_step`` on ``trainer`` over the rows of the missing shards, writing each shard
        whole, then wait for every rank; returns ``pending``."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        callbacks.insert(0, self)  # first: a callback after it sees this batch's shard on disk
        try:
            with warnings.catch_warnings():  # expected: an iterable of ready batches whose rows carry their index
                warnings.filterwarnings("ignore", message=".*IterableDataset` has `__len__` defined")
                warnings.filterwarnings("ignore", message="Couldn't infer the batch indices")
                trainer.predict(module, datamodule=_MissingShards(self), return_predictions=False)
        finally:
            callbacks.remove(self)
        trainer.strategy.barrier("sharded_writer")
        return self.pending

    def deal(self, trainer: L.Trainer) -> None:
        """Rank 0 lists the missing shards (``before_writing``), every rank gets the list and takes its share."""
        pending: list[int] = []
        if trainer.is_global_zero:
            pending = self.missing()
            if pending:
                self.before_writing(pending)
        self.pending = list(trainer.strategy.broadcast(pending, src=0))
        self.shards = self.pending[trainer.global_rank :: trainer.world_size]
        self.started = time.perf_counter()

    def batches(self) -> list[range]:
        """This rank's batches of rows."""
        return shard_batches(self.shards, self.num_rows, self.shard_size, self.batch_size)

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        for row, record in self.predicted_rows(prediction):
            shard = row // self.shard_size
            buffer = self.buffers.setdefault(shard, {})
            buffer[row] = record
            if len(buffer) == len(shard_rows(shard, self.num_rows, self.shard_size)):
                records = [buffer[index] for index in sorted(buffer)]
                write_atomically(self.path(shard), partial(self.write_records, records=records))
                del self.buffers[shard]

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.buffers:  # every shard a rank starts it finishes: a partial one means rows went missing
            raise RuntimeError(f"{self.what} {sorted(self.buffers)} did not receive all their rows.")


class _MissingShards(L.LightningDataModule):
    """Each rank's loader over its share of the writer's missing shards (dealt in ``setup``, when the processes
    can talk)."""

    def __init__(self, writer: ShardedWriter) -> None:
        super().__init__()
        self.writer = writer

    def setup(self, stage: str) -> None:
        assert self.trainer is not None  # Lightning calls setup from a trainer
        self.writer.deal(self.trainer)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self.writer), batch_size=None)


class _Batches(IterableDataset):
    """The writer's batches for this rank, in order (an iterable: Lightning adds no sampler)."""

    def __init__(self, writer: ShardedWriter) -> None:
        self.writer, self.batches = writer, writer.batches()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for rows in self.batches:
            yield self.writer.make_batch(rows)
