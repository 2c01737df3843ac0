"""What both DataModules hand to their DataLoaders: indexed rows and checked loader settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset

from lightning_gkd.data.chat_collator import ROW_INDEX


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
