r"""On-policy distillation as a policy gradient (OPD's training loss): on the student's own samples ``x_t`` the
reward of each token is ``r_t = log p_T(x_t) − log p_S(x_t)``, its advantage the ``gamma``-discounted sum of the
rewards from ``t`` to the row's end (optionally length-normalised, ``length_normalize``, and minus its row's mean,
``baseline="row"``), and the loss the surrogate ``−mean_t(w_t · A_t · log p_S(x_t))`` with truncated importance
weights ``w_t = min(p_S(x_t) / p_sampler(x_t), max_is_weight)``, PPO-clipped with ``clip_ratio`` (``ops.opd``).
``kl_coef > 0`` adds that many times the full-distribution generalized JSD (``DivergenceSettings``) on the same
positions.

Two teacher signals, chosen once when the loss is built: an in-process teacher's final hidden states and head
(``DensePolicyGradient``: the sampled token's log-prob and, for ``kl_coef``, the whole distribution) or a sparse
teacher's ``TopKSignal`` (``TopKPolicyGradient``: ``next_logprobs`` and its top-k with a tail bucket or
renormalised). Both read the student's final hidden states once for the reward and the ``kl_coef`` term.

Every batch is the student's samples; both also log the sample figures (``losses.base.sample_figures``): the
teacher's top-1 agreement and the student's entropy, and with an in-process teacher its mass on the student's top-5
(from the ``kl_coef`` term's chunks, else from a pass of both heads that also gives the rewards' teacher log-probs:
one student projection more, no gradients).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_gkd.losses.base import (
    DistillationLoss,
    LeanPath,
    Logged,
    LossOutput,
    finite_flag,
    sample_figure_logs,
    sample_figures,
)
from lightning_gkd.losses.dense import dense_divergence
from lightning_gkd.losses.settings import DivergenceSettings, PolicyGradientSettings
from lightning_gkd.losses.sparse import topk_divergence
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.divergence.opd import OPDStats, policy_gradient_distillation_loss
from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.divergence.topk import topk_log_probs
from lightning_gkd.ops.hf.forward import EosTokenId
from lightning_gkd.ops.hf.heads import LogitHead, hidden_states_and_head
from lightning_gkd.teachers.base import SparseTeacher, Teacher, next_tokens, supervised_positions


def eos_rate(labels: torch.Tensor, eos_token_id: EosTokenId) -> torch.Tensor | None:
    """The fraction of rows of a sampled batch (``labels`` ``(B, L)``) whose last supervised token is an EOS, i.e.
    whose sample ended within ``max_new_tokens`` (None without an EOS id or a supervised token)."""
    if eos_token_id is None:
        return None
    supervised = labels != IGNORE_INDEX
    sampled = supervised.any(dim=1)
    if not sampled.any():
        return None
    columns = torch.arange(labels.shape[1], device=labels.device)
    last = labels.gather(1, (supervised * columns).argmax(dim=1, keepdim=True)).squeeze(1)
    eos = torch.as_tensor(eos_token_id, device=labels.device).reshape(-1)
    return (torch.isin(last, eos) & sampled).float().sum() / sampled.sum()


@dataclass(frozen=True)
class Samples:
    """A batch of the student's samples at its ``N`` supervised positions (row-major): the ``batch``, the
    ``positions`` ``(B, L)``, the sampled ``tokens`` ``(N,)`` that follow them, the student's final ``hidden`` states
    ``(N, H)`` there and its ``head``, and the sample ``figures`` to fill (None: not gathered)."""

    batch: Mapping[str, Any]
    positions: torch.Tensor
    tokens: torch.Tensor
    hidden: torch.Tensor
    head: LogitHead
    figures: SampleFigures | None


class PolicyGradientDistillation(DistillationLoss):
    """The OPD loss (module docstring) on a batch of the student's samples, logging ``opd/reward``, ``opd/kl``
    (``−reward``, the sampled estimate of KL(S‖T)), ``opd/is_weight_mean``, ``opd/is_weight_max``,
    ``opd/is_truncated_fraction``, ``opd/advantage_mean``, ``opd/advantage_abs_mean``, ``opd/eos_rate``, with
    ``kl_coef > 0`` ``opd/divergence`` and with ``clip_ratio`` ``opd/clipped_fraction``. A subclass reads its
    teacher signal (``teacher_terms``).

    ``policy_gradient``: the surrogate's settings (``PolicyGradientSettings``: ``gamma``, ``max_is_weight``,
    ``length_normalize``, ``baseline`` and ``clip_ratio`` are ``policy_gradient_distillation_loss``'s; ``kl_coef``;
    ``importance_weights``: weight by ``p_S / p_sampler`` from the batch's ``sampled_logprobs``, which every shipped
    sampler writes; False, or a batch without them, uses ``w = 1``). ``divergence``: the ``kl_coef`` term's
    (``beta``, ``loss_temperature``; ``sparse_loss`` for a sparse teacher) and the chunk size. ``eos_token_id``: the
    student's EOS id(s), for ``opd/eos_rate``."""

    def __init__(
        self,
        policy_gradient: PolicyGradientSettings,
        divergence: DivergenceSettings,
        *,
        eos_token_id: EosTokenId = None,
    ) -> None:
        self.policy_gradient, self.divergence = policy_gradient, divergence
        self.eos_token_id = eos_token_id
        self.lean = LeanPath()

    def teacher_terms(self, samples: Samples) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(N,)`` the teacher's log-prob of each sampled token, the ``kl_coef`` term (None when ``kl_coef`` is
        0) and the teacher's finite flags; fills ``samples.figures`` when given."""
        raise NotImplementedError

    def __call__(self, student: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        ids = batch["input_ids"]
        positions = supervised_positions(batch["labels"])
        settings = self.policy_gradient

        def lean() -> LossOutput:
            hidden, head = hidden_states_and_head(student, ids, batch["attention_mask"], positions, batch.get("vision"))
            tokens = next_tokens(ids, positions)
            figures = sample_figures(batch, tokens)
            samples = Samples(batch, positions, tokens, hidden, head, figures)
            teacher_logprobs, divergence, finite = self.teacher_terms(samples)
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[positions]
            loss, stats = policy_gradient_distillation_loss(
                hidden,
                head,
                tokens,
                teacher_logprobs,
                rows=rows,
                sampler_logprobs=self.sampler_logprobs(batch, positions),
                gamma=settings.gamma,
                max_weight=settings.max_is_weight,
                length_normalize=settings.length_normalize,
                baseline=settings.baseline,
                clip_ratio=settings.clip_ratio,
                chunk_size=self.divergence.loss_chunk_size,
            )
            if divergence is not None:
                loss = loss + settings.kl_coef * divergence
            count = positions.sum()
            logs = {**self.logs(stats, divergence, batch["labels"], float(count)), **sample_figure_logs(figures)}
            return LossOutput(loss, count, logs, {"student": finite_flag(hidden), **finite})

        return self.lean.run(lean, None, loss_name="OPD")

    def sampler_logprobs(self, batch: Mapping[str, Any], positions: torch.Tensor) -> torch.Tensor | None:
        """``(N,)`` the log-prob each token following a True position was sampled with (None: no weights)."""
        logprobs = batch.get("sampled_logprobs")
        if logprobs is None or not self.policy_gradient.importance_weights:
            return None
        if logprobs.shape != batch["input_ids"].shape:
            raise ValueError(
                f"sampled_logprobs {tuple(logprobs.shape)} must match input_ids {tuple(batch['input_ids'].shape)}: "
                "the log-prob of each token at its own column (lightning_gkd.ops.decoding.sampling.completion_batch)."
            )
        return next_tokens(logprobs, positions)  # each position's next column, as for the tokens themselves

    def logs(
        self, stats: OPDStats, divergence: torch.Tensor | None, labels: torch.Tensor, tokens: float
    ) -> dict[str, Logged]:
        if not tokens:
            return {}
        logs = {
            "opd/reward": Logged(stats.mean_reward, tokens),
            "opd/kl": Logged(-stats.mean_reward, tokens),
            "opd/is_weight_mean": Logged(stats.mean_weight, tokens),
            "opd/is_weight_max": Logged(stats.max_weight, tokens, "max"),
            "opd/is_truncated_fraction": Logged(stats.truncated_fraction, tokens),
            "opd/advantage_mean": Logged(stats.mean_advantage, tokens),
            "opd/advantage_abs_mean": Logged(stats.mean_abs_advantage, tokens),
        }
        if stats.clipped_fraction is not None:
            logs["opd/clipped_fraction"] = Logged(stats.clipped_fraction, tokens)
        if divergence is not None:
            logs["opd/divergence"] = Logged(divergence.detach(), tokens)
        rate = eos_rate(labels, self.eos_token_id)
        if rate is not None:  # a share of the sampled rows
            logs["opd/eos_rate"] = Logged(rate, float((labels != IGNORE_INDEX).any(dim=1).sum()))
        return logs


class DensePolicyGradient(PolicyGradientDistillation):
    """OPD against an in-process teacher: the sampled token's log-prob from the teacher's final hidden states and
    head (no full logits), and for ``kl_coef`` the generalized JSD over its whole distribution."""

    def __init__(self, teacher: Teacher, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher

    def teacher_terms(self, samples: Samples) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        chunk_size, figures = self.divergence.loss_chunk_size, samples.figures
        teacher_hidden, teacher_head = self.teacher.hidden_states(samples.batch, samples.positions)
        if figures is not None and self.policy_gradient.kl_coef == 0:  # one pass of both heads: figures and rewards
            following = figures.add_hidden(
                samples.hidden,
                samples.head,
                teacher_hidden=teacher_hidden,
                teacher_head=teacher_head,
                chunk_size=chunk_size,
            )
        else:
            _, _, following = topk_log_probs(
                teacher_hidden, teacher_head, 1, next_tokens=samples.tokens, chunk_size=chunk_size
            )
        assert following is not None  # next_tokens or the teacher's hidden states were given
        divergence = None
        if self.policy_gradient.kl_coef > 0:
            divergence = dense_divergence(
                samples.hidden, samples.head, teacher_hidden, teacher_head, self.divergence, figures
            )
        return following, divergence, {"teacher": finite_flag(teacher_hidden)}


class TopKPolicyGradient(PolicyGradientDistillation):
    """OPD against a sparse teacher (a server; a local one with ``top_k``): the reward from
    ``TopKSignal.next_logprobs``, the ``kl_coef`` term over the top-k with a tail bucket (``sparse_loss="topk"``)
    or renormalised (``"topk_renorm"``)."""

    def __init__(self, teacher: SparseTeacher, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher

    def teacher_terms(self, samples: Samples) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        figures = samples.figures
        signal = self.teacher.topk(samples.batch, samples.positions).to(samples.hidden.device)
        if signal.next_logprobs is None:
            raise ValueError(
                f"OPD's reward is the teacher's log-prob of each sampled token, which {type(self.teacher).__name__} "
                "did not return (TopKSignal.next_logprobs is None): use teacher=local or teacher=server."
            )
        if figures is not None:
            figures.set_teacher_top1(signal.ids[:, 0])  # most likely first
        divergence = None
        if self.policy_gradient.kl_coef > 0:
            divergence = topk_divergence(samples.hidden, samples.head, signal, self.divergence, figures)
        elif figures is not None:
            figures.add_hidden(samples.hidden, samples.head, chunk_size=self.divergence.loss_chunk_size)
        return signal.next_logprobs, divergence, {}
