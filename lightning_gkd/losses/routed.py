"""Several teachers, each row scored by the one its routing column names (``teacher.kind=multi``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from lightning_gkd.data.loader import select_rows
from lightning_gkd.losses.base import DistillationLoss, Logged, LossOutput, combine
from lightning_gkd.teachers.routing import route_rows


class RoutedDistillation(DistillationLoss):
    """Each teacher's loss (``losses[name]``) on the rows whose ``column`` value names it; the batch's loss is the
    count-weighted mean over all of them (``combine``: a token mean over the whole batch), and per teacher
    ``teacher/<name>/loss`` and ``teacher/<name>/tokens`` are logged."""

    def __init__(self, column: str, losses: Mapping[str, DistillationLoss]) -> None:
        self.column = column
        self.losses = dict(losses)

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        parts = {
            name: self.losses[name](student, select_rows(batch, rows))
            for name, rows in route_rows(batch, self.column, list(self.losses)).items()
        }
        if not parts:
            raise ValueError("RoutedDistillation: the batch has no rows.")
        out = combine(list(parts.values()))
        logs = dict(out.logs)
        for name, part in parts.items():
            tokens = float(part.count)
            logs[f"teacher/{name}/loss"] = Logged(part.loss.detach(), weight=tokens)
            logs[f"teacher/{name}/tokens"] = Logged(tokens, reduce="sum")
        return replace(out, logs=logs)

    def check_datamodule(self, datamodule: Any) -> None:
        """The datamodule must carry the routing column into every batch (``ChatDataModule.carry_columns``)."""
        carry = getattr(datamodule, "carry_columns", None)
        if not callable(carry):
            raise TypeError(
                f"teacher.kind=multi routes rows by their {self.column!r} column: use a datamodule with "
                f"carry_columns (ChatDataModule), not {type(datamodule).__name__}."
            )
        carry([self.column])
        for loss in self.losses.values():
            loss.check_datamodule(datamodule)
