"""StudyRecord: what one run of a study (``lightning-gkd -m experiment=study_* recipe=...``) reports for its tables:
the validation curve, the training compute up to each validation, and (optionally) the run's own greedy and
temperature-1 completions of the held-out prompts, its start's and its teacher's. ``lightning_gkd.cli.sweep`` writes
it into the job's ``result.json`` (``study``); ``lightning_gkd.studies`` reads a sweep of them into tables."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from lightning_gkd.callbacks.length_guard import LengthGuard
from lightning_gkd.evaluation.completions import CompletionScores, score_completions
from lightning_gkd.evaluation.metrics import GenerationMetric, exact_match
from lightning_gkd.methods.base import require_lm_module
from lightning_gkd.models.loading import load_causal_lm, source_config
from lightning_gkd.ops.constants import IGNORE_INDEX


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def folder_parameter_count(name_or_path: str) -> int:
    """The parameters of the model saved in ``name_or_path`` (a causal LM, or a vision-language model whole), counted
    on the meta device (nothing loaded)."""
    config = source_config(name_or_path, role="teacher")
    if config is None:
        raise ValueError(f"{name_or_path!r} has no config.json to count the served teacher's parameters from.")
    with torch.device("meta"):
        return parameter_count(load_causal_lm(config))


class ComputeMeter:
    """Estimated training FLOPs and wall time: 2·params per token a model reads or writes without gradients, 6·params
    per trained token (attention ignored), for sampling (prompt + new tokens, by whichever model sampled; speculative
    KD: the student's drafts and the teacher's verification), teacher scoring and training; the seconds of the
    training steps (sampling included, validation excluded). ``attach`` wraps the module's sampling call and the loss
    a training step calls, to count their tokens; ``served_teacher``: the parameters of a teacher that scores outside
    the process (a server), counted like an in-process one."""

    def __init__(self) -> None:
        self.flops = 0.0
        self.seconds = 0.0
        self.tokens: dict[str, int] = {"generated": 0, "teacher_scored": 0, "trained": 0}
        self._started = 0.0

    def attach(self, module: Any, served_teacher: int = 0) -> None:
        """Wrap ``module``'s (a ``CausalLMModule``) training loss and sampling call to count their tokens."""
        student = parameter_count(module.model)
        teacher_model = getattr(module, "teacher", None)
        scores_with_teacher = teacher_model is not None or getattr(module, "teacher_source", None) is not None
        teacher = parameter_count(teacher_model) if teacher_model is not None else served_teacher
        teacher = teacher if scores_with_teacher else 0
        # what a training step calls: the on-policy methods' training_loss, SFT's completion_loss
        loss_name = "training_loss" if hasattr(module, "training_loss") else "completion_loss"
        loss_fn, sample_fn = getattr(module, loss_name), getattr(module, "sample_batch", None)

        def counted_loss(batch: dict[str, Any]) -> Any:
            if module.training:
                seen = int(batch["attention_mask"].sum())
                self.tokens["trained"] += seen
                self.flops += 6 * student * seen
                if teacher:
                    self.tokens["teacher_scored"] += seen
                    self.flops += 2 * teacher * seen
            return loss_fn(batch)

        def counted_sample(model: Any, batch: dict[str, Any], seed: int) -> dict[str, Any]:
            assert sample_fn is not None
            out = sample_fn(model, batch, seed)
            new = int((out["labels"] != IGNORE_INDEX).sum())
            self.tokens["generated"] += new
            read = new + int(batch["prompt_attention_mask"].sum())
            stats = module.sampler.last_stats() if module.sampler is not None else {}
            if model is not teacher_model and "teacher_tokens_per_token" in stats:
                verified = round(stats["teacher_tokens_per_token"] * new)
                self.tokens["teacher_verified"] = self.tokens.get("teacher_verified", 0) + verified
                self.flops += 2 * student * round(stats["student_tokens_per_token"] * new) + 2 * teacher * verified
            else:
                self.flops += 2 * (teacher if model is teacher_model else student) * read
            return out

        setattr(module, loss_name, counted_loss)
        if sample_fn is not None:
            module.sample_batch = counted_sample

    def step_started(self) -> None:
        self._started = time.perf_counter()

    def step_ended(self) -> None:
        self.seconds += time.perf_counter() - self._started


class StudyRecord(L.Callback):
    """Records a study run: ``curve`` ((step, ``monitor``) after each validation), ``compute`` ((step, estimated FLOPs,
    training seconds) at the same points; ``ComputeMeter``), the token counts, the last values of the ``train/*`` and
    ``val/*`` metrics, the steps where a ``LengthGuard`` warned, and with ``completions`` the trained model's greedy and
    temperature-1 completions of the datamodule's ``test_rows`` (``CompletionScores``: texts, ``metric``, EOS rate,
    length, entropy); with ``reference`` also its start's and its in-process teacher's (greedy and temperature 1, seed
    0) and its start's greedy ``metric`` on the validation rows (where every curve starts).

    ``recipe`` (what the study calls the method: ``name``, ``description``, ...), ``task``, ``arm``, ``seed`` and ``lr``
    are recorded as given, for the tables (``lightning_gkd.studies``). ``served_teacher``: the folder of a teacher that
    scores outside the process (``teacher=server``), whose parameters the FLOP estimate counts. ``run_summary`` hands
    everything to ``lightning-gkd``'s result (``study``)."""

    def __init__(
        self,
        recipe: Mapping[str, Any] | None = None,
        *,
        task: str | None = None,
        arm: str = "full",
        seed: int | None = None,
        lr: float | None = None,
        metric: GenerationMetric = exact_match,
        monitor: str = "val/accuracy",
        max_length: int = 1024,
        max_new_tokens: int = 32,
        completions: bool = False,
        reference: bool = False,
        served_teacher: str | None = None,
        batch_size: int = 256,
    ) -> None:
        self.recipe = dict(recipe or {})
        self.task, self.arm, self.seed, self.lr = task, arm, seed, lr
        self.metric, self.monitor = metric, monitor
        self.max_length, self.max_new_tokens = max_length, max_new_tokens
        self.completions, self.reference = completions, reference
        self.served_teacher = served_teacher
        self.batch_size = batch_size
        self.meter = ComputeMeter()
        self.curve: list[tuple[int, float]] = []
        self.compute: list[tuple[int, float, float]] = []
        self.scores: dict[str, dict[str, Any]] = {}
        self.settings: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}
        self.guard_alerts: list[int] = []

    def _score(self, model: torch.nn.Module, tokenizer: Any, rows: list[dict], sample_seed: int | None) -> Any:
        return score_completions(
            model,
            tokenizer,
            rows,
            metric=self.metric,
            max_length=self.max_length,
            max_new_tokens=self.max_new_tokens,
            sample_seed=sample_seed,
            batch_size=self.batch_size,
        )

    def _both(self, model: torch.nn.Module, tokenizer: Any, rows: list[dict], seed: int) -> dict[str, Any]:
        """Greedy and temperature-1 (``seed``) scores of ``model`` on ``rows``."""
        return {
            "greedy": _scores_record(self._score(model, tokenizer, rows, None)),
            "sampled": _scores_record(self._score(model, tokenizer, rows, seed)),
        }

    def _test_rows(self, trainer: L.Trainer) -> list[dict]:
        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's fit
        datamodule.setup("test")
        rows = getattr(datamodule, "test_rows", None)
        if rows is None:
            raise ValueError("StudyRecord(completions=true) scores the test rows: give the data a test_data.")
        return list(rows)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        module = require_lm_module(pl_module, type(self).__name__)
        self.recipe.setdefault("name", type(module).__name__)  # a run without a recipe: its method's class
        served = folder_parameter_count(self.served_teacher) if self.served_teacher else 0
        self.meter.attach(module, served_teacher=served)
        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's fit
        self.settings = {
            "steps": trainer.max_steps,
            "batch_size": getattr(datamodule, "batch_size", None),
            "eval_every": trainer.val_check_interval,
            "train_rows": len(getattr(datamodule, "train_rows", None) or []),
        }
        if not self.reference:
            return
        rows = self._test_rows(trainer)
        self.scores["student_init"] = self._both(module.model, module.tokenizer, rows, seed=0)
        val_rows = list(getattr(datamodule, "val_rows", None) or [])
        if val_rows:
            self.scores["student_init"]["val_accuracy"] = self._score(
                module.model, module.tokenizer, val_rows, None
            ).accuracy
        teacher = getattr(module, "teacher", None)
        if isinstance(teacher, torch.nn.Module) and callable(getattr(teacher, "generate", None)):
            self.scores["teacher"] = self._both(teacher, module.tokenizer, rows, seed=0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.meter.step_started()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.meter.step_ended()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.monitor in trainer.callback_metrics:
            self.curve.append((trainer.global_step, float(trainer.callback_metrics[self.monitor])))
        self.compute.append((trainer.global_step, self.meter.flops, self.meter.seconds))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.metrics = {
            key: float(value)
            for key, value in trainer.callback_metrics.items()
            if key.startswith(("train/", "val/")) and value.numel() == 1
        }
        guards = [c for c in trainer.callbacks if isinstance(c, LengthGuard)]  # type: ignore[attr-defined]
        self.guard_alerts = [int(alert["step"]) for guard in guards for alert in guard.alerts]
        if self.completions:
            module = require_lm_module(pl_module, type(self).__name__)
            rows = self._test_rows(trainer)
            seed = 0 if self.seed is None else self.seed
            self.scores["trained"] = self._both(module.model, module.tokenizer, rows, seed=seed)

    def record(self) -> dict[str, Any]:
        """What this run reports (JSON-ready)."""
        return {
            "recipe": self.recipe,
            "task": self.task,
            "arm": self.arm,
            "seed": self.seed,
            "lr": self.lr,
            "settings": self.settings,
            "curve": [list(point) for point in self.curve],
            "compute": [list(point) for point in self.compute],
            "tokens": dict(self.meter.tokens),
            "train_flops": self.meter.flops,
            "train_seconds": self.meter.seconds,
            "metrics": self.metrics,
            "length_guard_alerts": self.guard_alerts,
            "completions": self.scores,
        }

    def run_summary(self) -> dict[str, Any]:
        return {"study": self.record()}


def _scores_record(scores: CompletionScores) -> dict[str, Any]:
    return {"texts": scores.texts, **scores.figures()}
