"""The shipped toy tasks by name: their rows, metric, lengths and asset folders (used by the scripts that make the
assets and compare methods on them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_gkd.evaluation.metrics import GenerationMetric, exact_match
from lightning_gkd.toy.addition import addition_rows
from lightning_gkd.toy.chain import chain_rows, final_answer_match
from lightning_gkd.toy.tiny import CHAIN_STUDENT, CHAIN_TEACHER, TOY_STUDENT, TOY_TEACHER


@dataclass(frozen=True)
class ToyTask:
    """A shipped toy task: ``rows(split, num_rows)``, the metric that scores its answers, the generation and
    sequence lengths it needs, and where its teacher and student start live (``assets/<assets>/``)."""

    name: str
    description: str
    rows: Callable[..., list[dict[str, Any]]]
    metric: GenerationMetric
    max_new_tokens: int
    max_length: int
    assets: str
    teacher_config: dict[str, Any]
    student_config: dict[str, Any]


TOY_TASKS = {
    "addition": ToyTask(
        "addition",
        "3-digit addition, every number written units digit first; exact match of the answer",
        addition_rows,
        exact_match,
        max_new_tokens=8,
        max_length=64,
        assets="toy",
        teacher_config=TOY_TEACHER,
        student_config=TOY_STUDENT,
    ),
    "chain": ToyTask(
        "chain",
        "sum of four 2-digit numbers written step by step (units digit first) in one of two valid orders, "
        "23-31 answer tokens; exact match of the final sum",
        chain_rows,
        final_answer_match,
        max_new_tokens=40,
        max_length=80,
        assets="toy_chain",
        teacher_config=CHAIN_TEACHER,
        student_config=CHAIN_STUDENT,
    ),
}


def toy_task(name: str) -> ToyTask:
    """The toy task called ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in TOY_TASKS:
        raise ValueError(f"Unknown toy task {name!r}; use one of {sorted(TOY_TASKS)}.")
    return TOY_TASKS[name]
