"""HFExportCallback: a Hugging Face folder (``save_pretrained`` + tokenizer + model card) beside each checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightning_gkd.methods.base import require_lm_module


class HFExportCallback(L.Callback):
    """Export the trained model with ``module.export`` while training, as ``<dirpath>/step<N>-hf/`` (and, for a
    LoRA model with ``merged=True``, the merged full model as ``<dirpath>/step<N>-hf-merged/``), where ``N`` is the
    global step, the number in the default checkpoint names (``step<N>.ckpt``).

    - ``every_n_train_steps=None`` (default): whenever a checkpoint is saved (``on_save_checkpoint``: every
      ``ModelCheckpoint`` save, ``last.ckpt`` included, and the checkpoint ``SignalCheckpoint`` writes on SIGTERM),
      once per global step, so each checkpoint gets a folder next to it.
    - ``every_n_train_steps=k``: after every ``k``-th optimizer step, independently of checkpointing.

    Only global rank zero writes. Each folder is written beside its target and renamed into place, so an
    interrupted export never leaves a half-written folder under the final name. The module must have an
    ``export(path, card_info, merged_path=...)`` method (every ``CausalLMModule`` has). The written folders are
    listed in ``exported`` (global step -> folder).
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int | None = None, merged: bool = True) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(
                f"every_n_train_steps must be >= 1 or None (at each checkpoint), got {every_n_train_steps}."
            )
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.merged = merged
        self.exported: dict[int, Path] = {}

    def folder(self, step: int) -> Path:
        """Where the export of global step ``step`` goes (the merged model: the same name + ``-merged``)."""
        return self.dirpath / f"step{step}-hf"

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path | None:
        """Export the model at the current global step (rank zero, once per step); returns the folder."""
        step = trainer.global_step
        if not trainer.is_global_zero or step in self.exported or trainer.sanity_checking:
            return None
        target = self.folder(step)
        merged = target.with_name(f"{target.name}-merged") if self.merged else None
        module = require_lm_module(pl_module, type(self).__name__)
        self.exported[step] = module.export(target, card_info={"exported at global step": step}, merged_path=merged)
        rank_zero_info(f"Exported the model at step {step} to {target}")
        return target

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.strategy.__class__.__name__ == "ModelParallelStrategy":
            raise ValueError(
                "HFExportCallback writes from rank zero alone, but under trainer=fsdp the weights are "
                "sharded across ranks (gathering them takes every rank). Drop it "
                "(callbacks=[default]): the run still exports the full student at the end, and "
                "checkpoints hold the full student state."
            )

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.every_n_train_steps is None:
            self.export(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        if n is not None and trainer.global_step > 0 and trainer.global_step % n == 0:
            self.export(trainer, pl_module)
