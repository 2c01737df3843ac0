"""HeldOutEvaluation: score the model (and its teacher) on held-out prompts by greedy generation, before and
after training."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightning_gkd.evaluation.metrics import GenerationMetric, evaluate_generations, exact_match, gaps_closed
from lightning_gkd.methods.base import require_lm_module
from lightning_gkd.rollouts.evaluate import evaluate_rollouts


class HeldOutEvaluation(L.Callback):
    """Greedy-decode the datamodule's ``test_rows`` and score them with ``metrics`` (default exact-match
    ``accuracy``): the trained model at fit start ("before") and fit end ("after"), and the module's ``teacher``
    if it has one. With a teacher, also the recovered fraction of the teacher–student gap per metric
    (``lightning_gkd.evaluation.metrics.gap_closed``: (after − before) / (teacher − before); None, "n/a", when the
    teacher does not score above the start). Results go to ``self.results`` (``teacher``, ``before``, ``after``,
    ``gap_closed``), the logger (``test/<name>_before|after``, ``test/teacher_<name>``, ``test/<name>_gap_closed``
    where defined), ``held_out.json`` in the trainer's root dir (with ``num_rows`` and ``max_new_tokens``), and a
    printed table.

    With a method that rolls out with tools (``rollout``), each prompt is a greedy multi-turn rollout with the
    method's tools, scored on the transcript's final answer (plus ``tool_calls`` and ``tool_failures``).

    Every rank evaluates (sharded models need all ranks in each forward); rank zero reports.

    A resumed fit reports the run's own start: "before" and the teacher's scores are saved in every checkpoint
    (``state_dict``) and restored with it, instead of scoring the restored model again.
    """

    def __init__(
        self, metrics: Mapping[str, GenerationMetric] | None = None, max_new_tokens: int = 32, batch_size: int = 64
    ) -> None:
        self.metrics = {k: v for k, v in (metrics or {"accuracy": exact_match}).items() if v is not None}
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.results: dict[str, Mapping[str, float | None]] = {}
        self._restored = False  # the start's scores came with the checkpoint this fit resumes from

    def state_dict(self) -> dict[str, Any]:
        """The scores of the run's start (``teacher``, ``before``), so a resumed fit reports them."""
        return {"results": {key: dict(self.results[key]) for key in ("teacher", "before") if key in self.results}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        start = state_dict.get("results", {})
        if "before" in start:
            self.results = {**self.results, **start}
            self._restored = True

    def _rows(self, trainer: L.Trainer) -> Any:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None:
            return None
        datamodule.setup("test")
        return getattr(datamodule, "test_rows", None)

    def _evaluate(self, trainer: L.Trainer, model: Any, rows: Any, sampler: Any = None) -> dict[str, float]:
        return score_rows(
            trainer,
            model,
            rows,
            metrics=self.metrics,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            sampler=sampler,
        )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = self._rows(trainer)
        if rows is None:
            rank_zero_info("HeldOutEvaluation: the datamodule has no test_data; nothing to evaluate.")
            return
        if self._restored:  # a resume: the run's start was scored before its first step, not now
            scores = ", ".join(
                f"{name} {value:.3f}" for name, value in self.results["before"].items() if value is not None
            )
            rank_zero_info(f"HeldOutEvaluation: resumed; 'before' is the run's start, from the checkpoint ({scores}).")
            return
        self.results = {}
        if callable(getattr(getattr(pl_module, "teacher", None), "generate", None)):  # one in-process teacher
            self.results["teacher"] = self._evaluate(trainer, pl_module.teacher, rows)
        # the trained model through the method's sampler (a serving engine when sampler=vllm); the teacher through
        # our KV-cache decoder (no second engine for a model that is only evaluated)
        self.results["before"] = self._evaluate(trainer, pl_module.model, rows, getattr(pl_module, "sampler", None))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = self._rows(trainer)
        if rows is None:
            return
        self.results["after"] = self._evaluate(trainer, pl_module.model, rows, getattr(pl_module, "sampler", None))
        if "teacher" in self.results:
            scores = cast(dict[str, dict[str, float]], self.results)  # the three scores are never None
            scored = {name: scores["after"][name] for name in self.metrics}  # scores, not call counts
            self.results["gap_closed"] = gaps_closed(scored, scores["before"], scores["teacher"])
        flat = {
            f"test/{name}_{when}": value for when in ("before", "after") for name, value in self.results[when].items()
        }
        flat.update({f"test/teacher_{name}": v for name, v in self.results.get("teacher", {}).items()})
        flat.update({f"test/{name}_gap_closed": v for name, v in self.results.get("gap_closed", {}).items()})
        logged = {key: value for key, value in flat.items() if value is not None}  # an undefined gap is not logged
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=trainer.global_step)
                logger.save()
            out = Path(trainer.default_root_dir) / "held_out.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            saved = {"num_rows": len(rows), "max_new_tokens": self.max_new_tokens, **self.results}
            out.write_text(json.dumps(saved, indent=2))
        rank_zero_info(self.table(len(rows)))
        self._restored = False

    def table(self, num_rows: int) -> str:
        lines = [f"Held-out evaluation on {num_rows} test prompts (greedy):"]
        for name in self.metrics:
            parts = [
                f"{who} {self.results[key][name]:.3f}"
                for who, key in (("teacher", "teacher"), ("model before", "before"), ("model after", "after"))
                if key in self.results
            ]
            if "gap_closed" in self.results:
                gap = self.results["gap_closed"].get(name)
                parts.append(
                    "gap closed "
                    + ("n/a (the teacher does not score above the start)" if gap is None else f"{gap:.3f}")
                )
            lines.append(f"  {name}: " + " | ".join(parts))
        return "\n".join(lines)

    def run_summary(self) -> dict[str, Any]:
        """What ``lightning-gkd``'s summary and model card report: the held-out scores."""
        return {"held_out": self.results}


def score_rows(
    trainer: L.Trainer,
    model: Any,
    rows: Any,
    *,
    metrics: Mapping[str, GenerationMetric],
    max_new_tokens: int,
    batch_size: int,
    sampler: Any = None,
) -> dict[str, float]:
    """``metrics`` of ``model``'s greedy completions of ``rows`` (through ``sampler.greedy`` where it decodes): with a
    method that rolls out with tools, of its greedy rollouts' final answers (plus ``tool_calls`` and
    ``tool_failures``); with images, through the datamodule's processor."""
    module = require_lm_module(trainer.lightning_module, "score_rows")
    rollout = getattr(module, "rollout", None)
    if rollout is not None:  # an agent: its transcripts' final answers, with the method's tools
        return evaluate_rollouts(
            model,
            module.tokenizer,
            rows,
            rollout,
            metrics=metrics,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
        )
    return evaluate_generations(
        model,
        module.tokenizer,
        rows,
        metrics=metrics,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        processor=getattr(getattr(trainer, "datamodule", None), "processor", None),  # rows with images
    )
