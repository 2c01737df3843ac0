"""BestModel: keep the best checkpoint by a validation metric (TRL's ``metric_for_best_model`` and
``load_best_model_at_end``), and say when the student has fallen below where it started.

A run can end worse than it began while its loss and lengths look normal (OPD at too large a learning rate). The
callback scores the student on the validation prompts before its first step, as validation scores it, and warns
(or stops) once the metric has been worse than that start for ``patience`` validations in a row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_gkd.methods.base import require_lm_module

_OPTION = "callbacks.best_model"
MODES = ("max", "min", "auto")


class BestModel(L.Callback):
    """Track ``metric`` (a logged validation value, e.g. ``val/accuracy``; None: the method's first validation
    metric, ``val/<name>``, else ``val/loss``) at every validation of a fit.

    - **The best checkpoint** (``load_at_end=True``): at each validation that improves on the best so far
      (``mode``: "max", "min", or "auto": "min" for a name ending in ``loss``, else "max"), the full state is saved
      to ``best.ckpt`` in the checkpoint folder; when the fit ends the model's weights are restored from it, before
      the held-out "after" (``HeldOutEvaluation``, placed after this callback) and the export. ``best`` holds the
      value and the step.
    - **Below the start**: for a generation metric of the method (``val/<name>`` with ``name`` in its
      ``validation.metrics``), the start is scored before the first step on the validation prompts validation
      reads (greedy, ``validation.max_new_tokens``; the rows ``limit_val_batches`` keeps). When the metric has been
      worse than the start for ``patience`` validations in a row, it warns with the figures at each of them, and
      with ``stop=True`` stops the fit (``trainer.should_stop``; the best checkpoint, if kept, is still loaded).

    ``run_summary`` reports ``best_model`` (metric, mode, best value and step, start, whether it was loaded) and
    ``below_start`` (the warning, when given). The state (best, start) is saved in checkpoints: a resumed fit goes on
    from it.
    """

    def __init__(
        self,
        metric: str | None = None,
        mode: str = "auto",
        load_at_end: bool = False,
        patience: int = 3,
        stop: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"BestModel mode must be one of {MODES}, got {mode!r} ({_OPTION}.mode).")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"BestModel patience must be an integer >= 1 (validations in a row below the start before it "
                f"warns), got {patience!r} ({_OPTION}.patience)."
            )
        self.metric, self.mode, self.load_at_end, self.patience, self.stop = metric, mode, load_at_end, patience, stop
        self.best: dict[str, Any] | None = None  # {"value", "step"}
        self.start: float | None = None
        self.below = 0  # validations in a row below the start
        self.below_start: str | None = None  # the last warning
        self.loaded: str | None = None  # the checkpoint the weights were restored from at the end
        self._restored = False

    # -- what is watched ---------------------------------------------------------------------------------------------
    def watched(self, pl_module: L.LightningModule) -> str:
        if self.metric:
            return self.metric
        metrics = getattr(getattr(pl_module, "validation", None), "metrics", None) or {}
        return f"val/{next(iter(metrics))}" if metrics else "val/loss"

    def direction(self, metric: str) -> str:
        if self.mode != "auto":
            return self.mode
        return "min" if metric.endswith("loss") else "max"

    def _better(self, value: float, than: float, metric: str) -> bool:
        return value > than if self.direction(metric) == "max" else value < than

    def best_path(self, trainer: L.Trainer) -> Path:
        folder = getattr(trainer.checkpoint_callback, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
        return Path(folder) / "best.ckpt"

    # -- the start ---------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restored:  # a resume: the start and the best came with the checkpoint
            return
        self.best, self.start, self.below, self.below_start, self.loaded = None, None, 0, None, None
        module = require_lm_module(pl_module, type(self).__name__)
        metric = self.watched(pl_module)
        metrics = module.validation.metrics
        name = metric.removeprefix("val/")
        datamodule = getattr(trainer, "datamodule", None)
        rows = getattr(datamodule, "val_rows", None)
        if name not in metrics or not rows or getattr(datamodule, "val_names", None) or not trainer.limit_val_batches:
            return  # a loss, a named set's figure, or no validation: no start to compare with
        if "messages" not in rows[0]:
            return  # preference pairs (DPO): validation scores them its own way
        from lightning_gkd.callbacks.held_out_eval import score_rows

        rows = validated_rows(trainer, rows)
        scores = score_rows(
            trainer,
            pl_module.model,
            rows,
            metrics={name: metrics[name]},
            max_new_tokens=module.validation.max_new_tokens,
            batch_size=getattr(datamodule, "val_batch_size", None) or 64,
            sampler=getattr(pl_module, "sampler", None),
        )
        self.start = float(scores[name])
        rank_zero_info(f"BestModel: {metric} at the start {self.start:.4f} ({len(rows)} validation prompts).")

    # -- each validation ---------------------------------------------------------------------------------------------
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metric = self.watched(pl_module)
        logged = trainer.callback_metrics.get(metric)
        if logged is None:
            return
        value, step = float(logged), trainer.global_step
        if not math.isfinite(value):
            return
        if self.best is None or self._better(value, self.best["value"], metric):
            self.best = {"value": value, "step": step}
            if self.load_at_end:
                trainer.save_checkpoint(self.best_path(trainer), weights_only=False)
        if self.start is None:
            return
        self.below = self.below + 1 if self._better(self.start, value, metric) else 0
        if self.below >= self.patience:
            self.below_start = (
                f"{metric} has been below its start for {self.below} validations in a row: {value:.4f} at step "
                f"{step} against {self.start:.4f} before training"
                + (f" (best {self.best['value']:.4f} at step {self.best['step']})" if self.best else "")
            )
            advice = (
                "The run is making the student worse: lower optimizer.lr (OPD: 1e-4), check the method's settings, or "
                f"keep the best checkpoint ({_OPTION}.load_at_end=true)."
            )
            rank_zero_warn(f"BestModel: {self.below_start}. {advice}")
            if self.stop:
                trainer.should_stop = True

    # -- the end -----------------------------------------------------------------------------------------------------
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restored = False
        path = self.best_path(trainer)
        if not self.load_at_end or self.best is None or not path.is_file():
            return
        checkpoint = trainer.strategy.load_checkpoint(path)
        pl_module.on_load_checkpoint(checkpoint)  # the frozen models' weights are not in checkpoints
        trainer.strategy.load_model_state_dict(checkpoint, strict=pl_module.strict_loading)
        self.loaded = str(path)
        rank_zero_info(
            f"BestModel: restored the best checkpoint ({self.watched(pl_module)} {self.best['value']:.4f} at step "
            f"{self.best['step']}) from {path}: the export and the held-out 'after' use it."
        )

    # -- checkpoints and the summary ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "start": self.start, "below": self.below}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.start, self.below = state_dict.get("best"), state_dict.get("start"), state_dict.get("below", 0)
        self._restored = True

    def run_summary(self) -> dict[str, Any]:
        """What ``lightning-gkd``'s summary reports: the best checkpoint and the below-start warning."""
        summary: dict[str, Any] = {"below_start": self.below_start}
        if self.best is not None:
            summary["best_model"] = {**self.best, "start": self.start, "loaded": self.loaded}
        return summary


def validated_rows(trainer: L.Trainer, rows: Any) -> Any:
    """The validation rows a fit's validation reads: the first ``limit_val_batches`` batches (an integer) or that
    fraction of them (a float)."""
    limit = trainer.limit_val_batches
    size = getattr(getattr(trainer, "datamodule", None), "val_batch_size", None) or len(rows)
    batches = math.ceil(len(rows) / size)
    if isinstance(limit, float):
        kept = int(batches * limit) if limit < 1.0 else batches
    else:
        kept = min(int(limit), batches)
    return [rows[index] for index in range(min(kept * size, len(rows)))]  # a list also of a datasets.Dataset's rows
