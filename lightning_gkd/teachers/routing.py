"""Multi-teacher routing: each row of a batch names its teacher in a column (``teacher.kind=multi``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def route_rows(batch: Mapping[str, Any], column: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Row indices of ``batch`` per teacher name, in ``names`` order (teachers without rows left out).

    ``batch[column]`` is the list of the rows' teacher names (``ChatDataModule`` carries the column once the
    method asks for it). A name not in ``names`` raises ``ValueError`` naming it and the teachers there are."""
    values = batch.get(column)
    size = int(batch["input_ids"].shape[0])
    if not isinstance(values, (list, tuple)) or len(values) != size:
        raise ValueError(
            f"teacher.kind=multi routes rows by their {column!r} column, but the batch has "
            f"{'no such column' if values is None else f'{column}={values!r}'}: give every row a {column!r} value "
            "(one of the teacher names)."
        )
    unknown = sorted({str(value) for value in values} - set(names))
    if unknown:
        raise ValueError(
            f"Rows name teacher(s) {', '.join(map(repr, unknown))} in column {column!r}, but the teachers are "
            f"{', '.join(map(repr, names))} (teacher.teachers): fix the data or add the teacher."
        )
    routes = {name: [row for row, value in enumerate(values) if value == name] for name in names}
    return {name: torch.tensor(rows, dtype=torch.long) for name, rows in routes.items() if rows}
