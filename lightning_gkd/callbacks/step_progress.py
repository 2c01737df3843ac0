"""StepProgressBar: a run's progress in optimizer steps, as a bar on a terminal and as lines elsewhere."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from rich.console import Console
from rich.progress import ProgressColumn, Task
from rich.text import Text

from lightning_gkd.callbacks.print_metrics import PrintMetricsCallback, total_steps


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar counting optimizer steps toward ``max_steps`` ("step 30/200", one bar for the whole run,
    its time left the whole run's) instead of one bar per epoch ("Epoch 0/-2"), with the same metrics (without their
    ``train/`` prefix).

    Where stdout is no interactive terminal (a SLURM log, a pipe) a bar is useless: nothing is drawn, and a
    ``PrintMetricsCallback(every_n_steps)`` prints a line every few steps and after each validation instead.
    ``print_lines=True`` prints those lines on a terminal too, ``False`` never; ``None`` decides by the terminal.
    A ``PrintMetricsCallback`` of its own in the trainer's callbacks prints them instead.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        print_lines: bool | None = None,
        refresh_rate: int = 10,
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, console_kwargs=console_kwargs)
        self.print_lines = print_lines
        self.lines = PrintMetricsCallback(every_n_steps)
        self._printing = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        console = Console(**self._console_kwargs)
        live = console.is_interactive or console.is_jupyter
        self._printing = (not live) if self.print_lines is None else self.print_lines
        if any(isinstance(c, PrintMetricsCallback) for c in trainer.callbacks):  # type: ignore[attr-defined]
            self._printing = False  # one printing already (callbacks=[default,print_metrics])
        if not live:
            self.disable()

    # The train bar: one task for the whole fit, counting optimizer steps.

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:
            # Started at the current step, so a resumed fit's first update is one step (rich's speed, hence its
            # time left, comes from the size of each update).
            self.train_progress_bar_id = self.progress.add_task(
                self._step_description(trainer), total=total_steps(trainer), completed=trainer.global_step
            )
        self.refresh()

    def _initialize_train_progress_bar_id(self) -> None:  # Lightning's hook for a fit resumed mid-epoch
        self.on_train_epoch_start(self.trainer, self.trainer.lightning_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._printing:
            self.lines.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.is_disabled:
            return
        if self.train_progress_bar_id is None:
            self.on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(
                self.train_progress_bar_id, completed=trainer.global_step, description=self._step_description(trainer)
            )
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def _step_description(self, trainer: L.Trainer) -> str:
        total = total_steps(trainer)
        return f"step {trainer.global_step}" + (f"/{int(total)}" if math.isfinite(total) else "")

    def configure_columns(self, trainer: L.Trainer) -> list:
        columns = super().configure_columns(trainer)
        # The batch counter ("3/4") stays for validation; the train bar's count is its description.
        return [
            _UnlessTask(column, lambda task: task.id == self.train_progress_bar_id)
            if type(column).__name__ == "BatchesProcessedColumn"
            else column
            for column in columns
        ]

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        return {name.removeprefix("train/"): value for name, value in items.items()}

    # The lines (off a terminal, or print_lines=True).

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.lines.on_train_start(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._printing:
            self.lines.on_validation_end(trainer, pl_module)


class _UnlessTask(ProgressColumn):
    """``column``, rendered empty for the tasks ``skip`` picks."""

    def __init__(self, column: ProgressColumn, skip: Any) -> None:
        super().__init__()
        self.column, self.skip = column, skip

    def render(self, task: Task) -> Any:
        return Text() if self.skip(task) else self.column.render(task)
