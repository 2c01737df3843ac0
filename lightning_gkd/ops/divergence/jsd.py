"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions, from
logits (TRL's ``GKDTrainer.generalized_jsd_loss``: same signature, same values). Pure torch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lightning_gkd.ops.constants import IGNORE_INDEX

__all__ = ["generalized_jsd_loss", "generalized_jsd_terms", "to_compute_dtype"]

_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Upcast half-precision floats (fp16/bf16) to float32; leave fp32/fp64 unchanged."""
    if x.dtype in (torch.float32, torch.float64):
        return x
    return x.float()


def generalized_jsd_terms(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    r"""The elementwise terms :math:`\ell_v` of ``generalized_jsd_loss`` from log-probabilities (or the logs of
    unnormalised probabilities, as GOLD's hybrid takes them), same shape as the inputs; sum the last dimension for the
    divergence. ``beta`` 0: ``T (log T - log S)``; 1: ``S (log S - log T)``; else the mixture form."""
    if beta == 0.0:
        return log_t.exp() * (log_t - log_s)
    if beta == 1.0:
        return log_s.exp() * (log_s - log_t)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * (log_t.exp() * (log_t - log_m)) + (1.0 - beta) * (log_s.exp() * (log_s - log_m))


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Generalized Jensen-Shannon divergence between student and teacher token distributions.

    This is the divergence :math:`D_{JSD(\beta)}` of GKD (Agarwal et al., 2023,
    "On-Policy Distillation of Language Models", Eq. 1). With
    :math:`S = \mathrm{softmax}(z_s / \tau)` and :math:`T = \mathrm{softmax}(z_t / \tau)`
    taken over the vocabulary (last) dimension, the elementwise loss for vocabulary
    entry :math:`v` is

    .. math::

        \ell_v = \begin{cases}
            T_v (\log T_v - \log S_v) & \beta = 0 \quad \text{(forward KL, } KL(T \| S)) \\
            S_v (\log S_v - \log T_v) & \beta = 1 \quad \text{(reverse KL, } KL(S \| T)) \\
            \beta\, T_v (\log T_v - \log M_v) + (1 - \beta)\, S_v (\log S_v - \log M_v) & \text{otherwise}
        \end{cases}

    where the mixture :math:`M = \beta T + (1 - \beta) S` is computed in log space,
    :math:`\log M = \mathrm{logaddexp}(\log S + \log(1 - \beta), \log T + \log \beta)`.
    Summing :math:`\ell_v` over :math:`v` gives the per-token divergence.

    The softmax math runs in float32 for fp16/bf16 inputs (float64 inputs stay float64),
    and the result has that dtype. Values and gradients match TRL's
    ``GKDTrainer.generalized_jsd_loss``, except that an unknown ``reduction`` raises here,
    and ``reduction="mean"`` over zero valid positions gives 0 instead of NaN.

    Args:
        student_logits (torch.Tensor): student logits, shape ``(..., V)``, typically
            ``(B, T, V)``.
        teacher_logits (torch.Tensor): teacher logits, same shape as ``student_logits``.
        labels (torch.Tensor | None): integer tensor of shape ``(...)`` (the logits shape
            without the vocabulary dimension), typically ``(B, T)``. Positions equal to
            ``-100`` are dropped before reduction. Default: ``None`` (keep every position).
        beta (float): interpolation coefficient in ``[0, 1]``. ``0`` is forward KL,
            ``1`` is reverse KL, ``0.5`` is the symmetric JSD. Default: ``0.5``.
        temperature (float): softmax temperature, ``> 0``. Default: ``1.0``.
        reduction (str): one of

            - ``"batchmean"``: sum divided by the number of valid positions when
              ``labels`` is given (at least 1), else by the size of dim 0 (``B``, not
              ``B * T``).
            - ``"sum"``: sum over every element.
            - ``"mean"``: mean over every element, vocabulary entries included.
            - ``"none"``: the unreduced elementwise tensor, shape ``(..., V)`` without
              ``labels`` or ``(N, V)`` with ``labels`` (``N`` valid positions).

            Default: ``"batchmean"``.
        num_items_in_batch (int | torch.Tensor | None): if given, return
            ``sum / num_items_in_batch`` regardless of ``reduction`` (the global token
            count for gradient-accumulation-correct normalisation). Default: ``None``.

    Returns:
        torch.Tensor: a scalar, or the elementwise tensor for ``reduction="none"``.
        When every position is masked the (scalar) result is ``0`` and still carries a
        gradient path back to the logits (with zero gradients).

    Raises:
        ValueError: if ``beta`` is outside ``[0, 1]``, ``temperature <= 0``,
            ``reduction`` is unknown, or the shapes of the inputs do not agree.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "student_logits and teacher_logits must have the same shape, got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if student_logits.dim() < 1:
        raise ValueError("logits must have at least one (vocabulary) dimension")

    if labels is not None:
        if labels.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"labels must have shape {tuple(student_logits.shape[:-1])} "
                f"(logits without the vocabulary dim), got {tuple(labels.shape)}"
            )
        mask = labels.to(student_logits.device) != IGNORE_INDEX
        # Softmax is per row, so selecting the valid rows first gives identical values
        # while only materialising (N, V) instead of (B, T, V) intermediates.
        student_logits = student_logits[mask]
        teacher_logits = teacher_logits[mask]

    student_logits = to_compute_dtype(student_logits)
    teacher_logits = to_compute_dtype(teacher_logits)
    if temperature != 1.0:
        student_logits = student_logits / temperature
        teacher_logits = teacher_logits / temperature

    loss = generalized_jsd_terms(F.log_softmax(student_logits, dim=-1), F.log_softmax(teacher_logits, dim=-1), beta)

    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss.sum() / num_items_in_batch
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        # An empty selection (all positions masked) would give 0/0; return 0 instead.
        return loss.mean() if loss.numel() > 0 else loss.sum()
    # batchmean: with labels, dim 0 of the selected (N, V) tensor is the number of valid
    # positions N (clamped to 1 so that an all-masked batch gives 0, not NaN); without
    # labels it is the batch size B.
    return loss.sum() / max(loss.size(0), 1)
