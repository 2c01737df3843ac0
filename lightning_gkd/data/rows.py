"""Rows as the DataModules hold them: each row hands its index to the collator (``ROW_INDEX``), and
``RowsDataModule`` is what the chat and preference DataModules share (sources loaded once, the training loader of
``lightning_gkd.data.loader``, validation loaders)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
import lightning as L
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.loader import GroupedBatches, trainer_loader

#: Key under which the DataModules' datasets hand each row's index to the collator (for errors and caches).
ROW_INDEX = "row_index"


class RowDataset(Dataset):
    """Index-access view over rows (a ``datasets.Dataset`` or a list of dicts); collation does the tokenizing.

    Each row comes with its index under ``row_index`` (the row itself is not modified), so errors can name it and
    per-row caches (DPO's precomputed reference log-probs) can be keyed by it.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.rows[index], ROW_INDEX: index}


def check_loader_settings(batch_size: int, max_length: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}.")


class RowsDataModule(L.LightningDataModule):
    """What the chat and preference DataModules share: row sources loaded once by ``setup`` (``_load``, defined by
    each subclass, reads and checks one split), this module's resumable rank-sharded training loader
    (``GroupedBatches``) over ``collator``, and plain validation loaders."""

    collator: Callable[[list[Any]], Mapping[str, Any]]
    steps_per_generation: int = 1

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        train_data: Any,
        val_data: Any,
        *,
        batch_size: int,
        val_batch_size: int | None,
        max_length: int,
        train_split: str,
        val_split: str,
        num_workers: int,
        shuffle: bool,
        seed: int,
        length_check_rows: int | None,
    ) -> None:
        super().__init__()
        check_loader_settings(batch_size, max_length)
        self.tokenizer = tokenizer
        self.train_source, self.val_source = train_data, val_data
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.max_length = max_length
        self.train_split, self.val_split = train_split, val_split
        self.num_workers, self.shuffle, self.seed = num_workers, shuffle, seed
        self.length_check_rows = length_check_rows
        #: Batches each training batch announces ahead of itself (``data.loader.UPCOMING``; ``look_ahead``).
        self.batches_ahead = 0
        self.train_rows: Sequence[Mapping[str, Any]] | None = None
        #: Names of the validation sets when ``val_data`` is a dict; None for a single (unnamed) set.
        self.val_names: list[str] | None = named_val_sets(val_data)
        # val_rows: the only (or the first named) validation set
        self.val_rows: Sequence[Mapping[str, Any]] | None = None
        self.val_sets: dict[str, Sequence[Mapping[str, Any]]] | None = None  # name -> rows, when named

    def _load(self, source: Any, split: str, name: str) -> Sequence[Mapping[str, Any]]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is None:
            self.train_rows = self._load(self.train_source, self.train_split, "train_data")
        if self.val_rows is None and self.val_names is not None:
            self.val_sets = {
                name: self._load(self.val_source[name], self.val_split, f"val_data[{name!r}]")
                for name in self.val_names
            }
            self.val_rows = self.val_sets[self.val_names[0]]
        if self.val_rows is None and self.val_source is not None:
            self.val_rows = self._load(self.val_source, self.val_split, "val_data")

    def train_dataloader(self) -> GroupedBatches:
        self.setup("fit")
        assert self.train_rows is not None  # setup("fit") loaded them
        return trainer_loader(
            RowDataset(self.train_rows),
            self.collator,
            self.trainer,
            batch_size=self.batch_size,
            steps_per_generation=self.steps_per_generation,
            shuffle=self.shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            ahead=self.batches_ahead,
        )

    def look_ahead(self, batches: int) -> None:
        """Make each training batch carry the batches up to ``batches`` after it (``data.loader.UPCOMING``): a method
        with asynchronous rollouts calls it, to sample them before their step. ValueError with grouped generation."""
        steps = self.steps_per_generation
        if batches and steps > 1:
            raise ValueError(
                f"Asynchronous rollouts (method.asynchronous.max_staleness > 0) sample batch by batch and do not take "
                f"grouped generation (data.steps_per_generation={steps}): set data.steps_per_generation=1, or "
                "method.asynchronous.max_staleness=0."
            )
        self.batches_ahead = batches

    def val_dataloader(self) -> DataLoader | list:
        """One loader for a single validation set; a list of loaders, in ``val_names`` order, for named sets (the
        methods then log ``val/<name>/...`` per set)."""
        self.setup("validate")
        if self.val_rows is None:
            return []
        if self.val_sets is None:
            return self.val_loader(self.val_rows, self.val_collator_for(None))
        return [self.val_loader(rows, self.val_collator_for(name)) for name, rows in self.val_sets.items()]

    def val_collator_for(self, name: str | None) -> Callable[[list[Any]], Any]:
        """The collator of validation set ``name`` (None: the only one): the training collator by default."""
        return self.collator

    def val_loader(self, rows: Sequence[Mapping[str, Any]], collator: Callable[[list[Any]], Any]) -> DataLoader:
        """A plain loader over ``rows`` in order, ``val_batch_size`` rows a batch."""
        return DataLoader(
            RowDataset(rows),
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=collator,
            num_workers=self.num_workers,
        )


class ChainedRows(Sequence[Mapping[str, Any]]):
    """Several row sequences read as one, in order, without copying them."""

    def __init__(self, parts: Sequence[Sequence[Mapping[str, Any]]]) -> None:
        self.parts = list(parts)
        self._starts = [0]
        for part in self.parts:
            self._starts.append(self._starts[-1] + len(part))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Mapping[str, Any]:  # type: ignore[override]  # no slices
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        part = bisect.bisect_right(self._starts, index) - 1
        return self.parts[part][index - self._starts[part]]


def fit_rows(datamodule: Any) -> ChainedRows:
    """The rows a fit reads through the teacher: the training rows, then every validation set's (after ``setup``).
    What an offline teacher cache is built over, so both the training and the validation loss find their rows."""
    datamodule.setup("fit")
    val_sets = getattr(datamodule, "val_sets", None)
    val = list(val_sets.values()) if val_sets else [datamodule.val_rows] if datamodule.val_rows is not None else []
    return ChainedRows([datamodule.train_rows or [], *val])


def named_val_sets(val_data: Any) -> list[str] | None:
    """The names of several validation sets (``val_data`` a plain dict of name -> source), else None."""
    if not isinstance(val_data, Mapping) or isinstance(val_data, (datasets.DatasetDict, datasets.Dataset)):
        return None
    if not val_data:
        raise ValueError("val_data is an empty dict; give {name: source, ...} with at least one set, or None.")
    bad = [name for name in val_data if not isinstance(name, str) or not name or "/" in name]
    if bad:
        raise ValueError(
            f"val_data names must be non-empty strings without '/' (they become metric names "
            f"val/<name>/loss), got {bad!r}."
        )
    return list(val_data)
