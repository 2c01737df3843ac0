"""Losses against a sparse teacher signal (``TopKSignal``: an offline cache, a vLLM server, an in-process teacher's
top-k): the generalized JSD over the teacher's top-k (with a tail bucket, or renormalised), and the sampled-token
reverse-KL estimators k1/k3.

On a batch of the student's own samples both also log ``teacher_top1_agreement`` (from the signal's first id, the
teacher's most likely token) and ``student_entropy`` (``losses.base.sample_figures``); not the teacher's mass on the
student's top-k, which needs the teacher's probabilities of tokens outside its own top-k."""

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
from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.divergence.sparse_kd import sampled_kl_loss, topk_distillation_loss
from lightning_gkd.ops.hf.heads import LogitHead, hidden_states_and_head
from lightning_gkd.teachers.base import SparseTeacher, TopKSignal, next_tokens, supervised_positions


def topk_divergence(
    hidden: torch.Tensor,
    head: LogitHead,
    signal: TopKSignal,
    divergence: DivergenceSettings,
    figures: SampleFigures | None = None,
) -> torch.Tensor:
    """``divergence``'s generalized JSD between the teacher's top-k log-probs (``signal``, at the same ``N`` positions
    as the student's final hidden states ``(N, H)``) and the student: over the k tokens plus one bucket for the rest
    (``sparse_loss="topk"``) or both renormalised over the k (``"topk_renorm"``), ``loss_chunk_size`` positions at a
    time (``ops.sparse_kd.topk_distillation_loss``); fills ``figures`` when given."""
    return topk_distillation_loss(
        hidden,
        head,
        signal.ids,
        signal.logprobs,
        beta=divergence.beta,
        tail=divergence.sparse_loss == "topk",
        chunk_size=divergence.loss_chunk_size,
        figures=figures,
    )


class TopKDistillation(DistillationLoss):
    """``divergence``'s generalized JSD (``beta``) between the teacher's top-k log-probs and the student at every
    supervised position: over the k tokens plus one bucket for the rest of the vocabulary (``sparse_loss="topk"``:
    the exact divergence of those coarse distributions, the full one at k = V), or both renormalised over the k
    (``"topk_renorm"``). From the student's final hidden states (``topk_divergence``); no full-logits path. Masked
    entries of the signal (``TopKSignal``: ids past the student's vocabulary from a padded served teacher) count for
    nothing: their mass stays in the rest bucket (``topk``) or is dropped with it (``topk_renorm``)."""

    def __init__(self, teacher: SparseTeacher, divergence: DivergenceSettings | None = None) -> None:
        self.teacher = teacher
        self.divergence = divergence or DivergenceSettings()
        self.lean = LeanPath()

    @property
    def tail(self) -> bool:
        """Whether the rest of the vocabulary is one bucket (``sparse_loss="topk"``), else renormalised."""
        return self.divergence.sparse_loss == "topk"

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        positions = supervised_positions(batch["labels"])

        def lean() -> LossOutput:
            hidden, head = hidden_states_and_head(
                student, batch["input_ids"], batch["attention_mask"], positions, batch.get("vision")
            )
            signal = self.teacher.topk(batch, positions).to(hidden.device)
            figures = sample_figures(batch, next_tokens(batch["input_ids"], positions), signal.ids[:, 0])
            loss = topk_divergence(hidden, head, signal, self.divergence, figures)
            logs = sample_figure_logs(figures)
            return LossOutput(loss, positions.sum(), logs, finite={"student": finite_flag(hidden)})

        return self.lean.run(lean, None, loss_name="top-k")


class SampledDistillation(DistillationLoss):
    """A sampled-token estimate of the reverse KL(S‖T) on the student's own samples (``divergence.sparse_loss``:
    ``k1`` unbiased, ``k3`` non-negative and lower-variance; ``ops.sparse_kd.sampled_kl_loss``), from the teacher's
    log-prob of each sampled token (``TopKSignal.next_logprobs``)."""

    def __init__(self, teacher: SparseTeacher, divergence: DivergenceSettings) -> None:
        if divergence.sparse_loss not in ("k1", "k3"):
            raise ValueError(
                f"SampledDistillation estimates with sparse_loss k1 or k3, got {divergence.sparse_loss!r}: use "
                "TopKDistillation for topk and topk_renorm."
            )
        self.teacher = teacher
        self.divergence = divergence
        self.lean = LeanPath()

    @property
    def estimator(self) -> str:
        return self.divergence.sparse_loss

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        ids = batch["input_ids"]
        positions = supervised_positions(batch["labels"])

        def lean() -> LossOutput:
            hidden, head = hidden_states_and_head(student, ids, batch["attention_mask"], positions, batch.get("vision"))
            signal = self.teacher.topk(batch, positions).to(hidden.device)
            if signal.next_logprobs is None:
                raise ValueError(
                    f"sparse_loss={self.estimator} needs the teacher's log-prob of each sampled token, which "
                    f"{type(self.teacher).__name__} did not return; use sparse_loss=topk."
                )
            tokens = next_tokens(ids, positions)
            figures = sample_figures(batch, tokens, signal.ids[:, 0])
            loss = sampled_kl_loss(
                hidden,
                head,
                tokens,
                signal.next_logprobs,
                estimator=self.estimator,
                chunk_size=self.divergence.loss_chunk_size,
                figures=figures,
            )
            logs = sample_figure_logs(figures)
            return LossOutput(loss, positions.sum(), logs, finite={"student": finite_flag(hidden)})

        return self.lean.run(lean, None, loss_name=f"sampled {self.estimator}")
