"""The generalized JSD against an in-process teacher's full distributions (GKD's loss)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_gkd.losses.base import LeanPath, LossOutput, finite_flag, sample_figure_logs, sample_figures
from lightning_gkd.ops.divergence.chunked_jsd import projected_jsd_loss
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.ops.hf.forward import causal_lm_logits
from lightning_gkd.ops.hf.heads import hidden_states_and_head
from lightning_gkd.teachers.base import Teacher, next_tokens, supervised_positions


class DenseDistillation:
    """The generalized JSD (``beta``: 0 forward KL, 1 reverse KL) at ``temperature`` between the student's and
    ``teacher``'s next-token distributions at every supervised position, a token mean.

    Lean (default): only the supervised positions are projected to logits, ``chunk_size`` at a time, from both
    models' final hidden states (``ops.chunked_jsd.projected_jsd_loss``); full ``(B, L, V)`` logits never exist.
    A model whose head the lean path cannot describe falls back to full logits and ``generalized_jsd_loss``
    (``LeanPath``, shared by the run's losses).

    On a batch of the student's own samples it also logs, from the same chunks of logits, ``teacher_top1_agreement``,
    ``teacher_mass_on_student_top5`` and ``student_entropy`` (``losses.base.sample_figures``)."""

    def __init__(
        self,
        teacher: Teacher,
        *,
        beta: float = 0.5,
        temperature: float = 1.0,
        chunk_size: int = 64,
        lean: LeanPath | None = None,
    ) -> None:
        self.teacher = teacher
        self.beta, self.temperature, self.chunk_size = beta, temperature, chunk_size
        self.lean = lean or LeanPath()

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        positions = supervised_positions(batch["labels"])
        count = positions.sum()
        figures = sample_figures(batch, next_tokens(batch["input_ids"], positions))

        def lean() -> LossOutput:
            hidden, head = hidden_states_and_head(student, batch["input_ids"], batch["attention_mask"], positions)
            teacher_hidden, teacher_head = self.teacher.hidden_states(batch, positions)
            loss = projected_jsd_loss(
                hidden,
                head,
                teacher_hidden,
                teacher_head,
                beta=self.beta,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                figures=figures,
            )
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
                beta=self.beta,
                temperature=self.temperature,
            )
            if figures is not None:
                figures.add_positions(student_logits, teacher_logits, positions, chunk_size=self.chunk_size)
            return LossOutput(loss, count, sample_figure_logs(figures))

        return self.lean.run(lean, full, loss_name="generalized JSD")
