"""The generalized JSD against an in-process teacher's full distributions (GKD's loss)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_gkd.losses.base import (
    DistillationLoss,
    LeanPath,
    LossOutput,
    finite_flag,
    sample_figure_logs,
    sample_figures,
)
from lightning_gkd.losses.settings import DivergenceSettings
from lightning_gkd.ops.divergence.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.hf.heads import LogitHead, hidden_states_and_head
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits
from lightning_gkd.teachers.base import Teacher, next_tokens, supervised_positions


def dense_divergence(
    hidden: torch.Tensor,
    head: LogitHead,
    teacher_hidden: torch.Tensor,
    teacher_head: LogitHead,
    divergence: DivergenceSettings,
    figures: SampleFigures | None = None,
) -> torch.Tensor:
    """``divergence``'s generalized JSD from both models' final hidden states ``(N, H)`` and heads at the same ``N``
    positions, ``loss_chunk_size`` positions projected to logits at a time (``ops.chunked_jsd.projected_jsd_loss``);
    fills ``figures`` from the same chunks when given."""
    return projected_jsd_loss(
        hidden,
        head,
        teacher_hidden,
        teacher_head,
        beta=divergence.beta,
        temperature=divergence.loss_temperature,
        chunk_size=divergence.loss_chunk_size,
        figures=figures,
    )


class DenseDistillation(DistillationLoss):
    """``divergence``'s generalized JSD (``beta``: 0 forward KL, 1 reverse KL) at ``loss_temperature`` between the
    student's and ``teacher``'s next-token distributions at every supervised position, a token mean.

    Lean (default): only the supervised positions are projected to logits, ``loss_chunk_size`` at a time, from both
    models' final hidden states (``dense_divergence``); full ``(B, L, V)`` logits never exist. A model whose head the
    lean path cannot describe falls back to full logits and ``generalized_jsd_loss`` (``lean``: the ``LeanPath`` the
    run's losses share; None: one of its own, enabled as ``divergence.lean_loss`` says).

    On a batch of the student's own samples it also logs, from the same chunks of logits, ``teacher_top1_agreement``,
    ``teacher_mass_on_student_top5`` and ``student_entropy`` (``losses.base.sample_figures``)."""

    def __init__(
        self, teacher: Teacher, divergence: DivergenceSettings | None = None, *, lean: LeanPath | None = None
    ) -> None:
        self.teacher = teacher
        self.divergence = divergence or DivergenceSettings()
        self.lean = lean or LeanPath(self.divergence.lean_loss)

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        positions = supervised_positions(batch["labels"])
        count = positions.sum()
        figures = sample_figures(batch, next_tokens(batch["input_ids"], positions))

        def lean() -> LossOutput:
            hidden, head = hidden_states_and_head(
                student, batch["input_ids"], batch["attention_mask"], positions, batch.get("vision")
            )
            teacher_hidden, teacher_head = self.teacher.hidden_states(batch, positions)
            loss = dense_divergence(hidden, head, teacher_hidden, teacher_head, self.divergence, figures)
            # no logits for the non-finite guard's watch on this path: report the hidden states instead
            finite = {"student": finite_flag(hidden), "teacher": finite_flag(teacher_hidden)}
            return LossOutput(loss, count, sample_figure_logs(figures), finite)

        def full() -> LossOutput:
            student_logits = causal_lm_logits(student, batch)
            teacher_logits = self.teacher.logits(batch)
            loss = generalized_jsd_loss(
                student_logits[:, :-1],
                teacher_logits[:, :-1],
                labels=batch["labels"][:, 1:],
                beta=self.divergence.beta,
                temperature=self.divergence.loss_temperature,
            )
            if figures is not None:
                figures.add_positions(
                    student_logits, teacher_logits, positions, chunk_size=self.divergence.loss_chunk_size
                )
            return LossOutput(loss, count, sample_figure_logs(figures))

        return self.lean.run(lean, full, loss_name="generalized JSD")
