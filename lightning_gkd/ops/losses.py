"""Distillation and preference losses.

Pure tensor functions with no dependency on Lightning, so they can be unit-tested
and reused on their own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "PREFERENCE_LOSS_TYPES",
    "SMOOTHED_LOSS_TYPES",
    "check_preference_args",
    "generalized_jsd_loss",
    "preference_loss",
    "sequence_logps",
    "unused_label_smoothing",
]

#: Label value marking positions that do not contribute to the loss.
IGNORE_INDEX: int = -100

_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
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

    student_logits = _to_compute_dtype(student_logits)
    teacher_logits = _to_compute_dtype(teacher_logits)
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


# --------------------------------------------------------------------------- preference tuning

#: The preference losses ``preference_loss`` offers: TRL 1.16's ``sigmoid``, ``hinge``, ``ipo``, ``robust`` and
#: ``exo_pair`` (same names, same values), and ``cdpo``, conservative DPO (TRL <= 0.24's ``sigmoid`` with
#: ``label_smoothing``), which TRL 1.16 no longer offers.
PREFERENCE_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "cdpo", "robust", "exo_pair")
#: The losses that read ``label_smoothing``; the others ignore it, as TRL 1.16 does.
SMOOTHED_LOSS_TYPES = ("cdpo", "robust", "exo_pair")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    r"""Sum of the log-probabilities of the label tokens of each sequence.

    .. math::

        \log \pi(y \mid x) = \sum_{t:\, y_t \ne \text{ignore}}
            \big(z_{t, y_t} - \operatorname{logsumexp}_v z_{t, v}\big)

    Equal to ``log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)`` summed over valid positions, but
    without a second ``(B, T, V)`` tensor: the target logit is gathered and a logsumexp, taken one row at a time
    (in float32 for half-precision logits), is subtracted.

    Args:
        logits: ``(B, T, V)``; ``logits[:, t]`` predicts ``labels[:, t]`` (already shifted).
        labels: ``(B, T)`` token ids; ``ignore_index`` marks positions that do not count (prompt, padding).

    Returns:
        ``(B,)`` float32 (float64 for float64 logits); 0 for a row without a valid position.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"Expected logits (B, T, V) and labels (B, T), got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    mask = labels != ignore_index
    targets = labels.masked_fill(~mask, 0).unsqueeze(-1)
    picked = _to_compute_dtype(logits.gather(-1, targets).squeeze(-1))
    # One row at a time keeps the float32 copy of half-precision logits at (T, V).
    log_norm = torch.stack([torch.logsumexp(_to_compute_dtype(row), dim=-1) for row in logits])
    return ((picked - log_norm) * mask).sum(dim=-1)


def check_preference_args(beta: float, loss_type: str, label_smoothing: float = 0.0) -> None:
    """The one check of the preference-loss options (``preference_loss`` and ``DPOModule``): ValueError naming the
    option and its value."""
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of {PREFERENCE_LOSS_TYPES}, got {loss_type!r}. TRL's other DPO losses "
            "(nca_pair, bco_pair, sppo_hard, aot, apo_zero, apo_down, discopop, sft, sigmoid_norm) are not offered; "
            "subclass DPOModule and override pair_loss for one of them."
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}.")
    if loss_type == "exo_pair" and label_smoothing == 0.0:
        raise ValueError(
            "loss_type='exo_pair' needs label_smoothing > 0 (its target puts ε on the rejected completion; "
            "log 0 is infinite). The EXO paper recommends label_smoothing=1e-3."
        )


def unused_label_smoothing(loss_type: str, label_smoothing: float) -> str | None:
    """The warning to give when ``label_smoothing`` is set for a loss that ignores it, else None.

    TRL 1.16 ignores ε everywhere but ``robust`` and ``exo_pair``; TRL <= 0.24 (and this project before it matched
    TRL 1.16) applied it to ``sigmoid`` as conservative DPO, so a ported config would silently train another loss.
    """
    if not label_smoothing or loss_type in SMOOTHED_LOSS_TYPES:
        return None
    message = (
        f"label_smoothing={label_smoothing} has no effect with loss_type={loss_type!r}: as in TRL 1.16, only "
        f"{', '.join(SMOOTHED_LOSS_TYPES)} use it."
    )
    if loss_type == "sigmoid":
        message += (
            " TRL <= 0.24 applied it to sigmoid as conservative DPO; for that loss set loss_type=cdpo "
            "(Hydra: method.loss_type=cdpo)."
        )
    return message + " Set label_smoothing=0 to silence this."


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Per-pair preference loss (DPO and variants) from sequence log-probs of policy and reference.

    With the log-ratios :math:`r_c = \pi_c - \text{ref}_c`, :math:`r_r = \pi_r - \text{ref}_r`,
    :math:`\Delta = r_c - r_r` and :math:`z = \beta\Delta` (β multiplies the whole difference), ε =
    ``label_smoothing``:

    - ``"sigmoid"`` (DPO): :math:`-\log\sigma(z)`; ln 2 when policy == reference. Ignores ε, as TRL 1.16 does.
    - ``"hinge"`` (SLiC): :math:`\max(0,\ 1 - z)`. Ignores ε.
    - ``"ipo"``: :math:`(r_c / |c| - r_r / |r| - \tfrac{1}{2\beta})^2` with completion lengths :math:`|c|, |r|`
      (the length-normalised form TRL uses). Ignores ε.
    - ``"cdpo"`` (conservative DPO, labels flipped with probability ε):
      :math:`-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)`; TRL <= 0.24's ``sigmoid``.
    - ``"robust"`` (robust DPO, an unbiased loss under label noise ε):
      :math:`\big(-(1-\varepsilon)\log\sigma(z) + \varepsilon\log\sigma(-z)\big) / (1 - 2\varepsilon)`.
    - ``"exo_pair"`` (EXO): :math:`\mathrm{KL}\big((\sigma(z), \sigma(-z))\,\|\,(1-\varepsilon, \varepsilon)\big)`,
      ε > 0.

    Values equal TRL 1.16's ``DPOTrainer`` losses of the same names. The implicit rewards are
    ``beta * (logps - ref_logps)``.

    Args:
        chosen_logps, rejected_logps: ``(B,)`` policy sequence log-probs of the chosen / rejected completions.
        ref_chosen_logps, ref_rejected_logps: ``(B,)`` the same under the reference model (no gradient needed).
        beta: ``> 0``, the strength of the implicit KL penalty.
        loss_type: one of ``PREFERENCE_LOSS_TYPES``.
        label_smoothing: ε in ``[0, 0.5)``, read by ``"cdpo"``, ``"robust"`` and ``"exo_pair"`` only
            (``unused_label_smoothing`` gives the warning for the others).
        chosen_lengths, rejected_lengths: ``(B,)`` completion token counts, required for ``"ipo"``.

    Returns:
        ``(B,)`` losses, one per pair (take ``.mean()`` for the batch loss).
    """
    check_preference_args(beta, loss_type, label_smoothing)
    shapes = {tuple(t.shape) for t in (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)}
    if len(shapes) != 1 or chosen_logps.dim() != 1:
        raise ValueError(f"The four log-prob tensors must all have shape (B,), got {sorted(shapes)}.")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                "loss_type='ipo' normalises by completion length: pass chosen_lengths and "
                "rejected_lengths (token counts, shape (B,))."
            )
        delta = chosen_ratio / chosen_lengths.clamp(min=1).to(
            chosen_ratio.dtype
        ) - rejected_ratio / rejected_lengths.clamp(min=1).to(rejected_ratio.dtype)
        return (delta - 1.0 / (2.0 * beta)) ** 2
    logits = beta * (chosen_ratio - rejected_ratio)
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -F.logsigmoid(logits)
    if loss_type == "hinge":
        return torch.relu(1.0 - logits)
    if loss_type == "cdpo":
        return -(1.0 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    if loss_type == "robust":
        return (-(1.0 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1.0 - 2.0 * eps)
    # exo_pair: the KL from the model's pairwise preference (σ(z), σ(-z)) to the smoothed target (1 - ε, ε)
    log_p, log_q = F.logsigmoid(logits), F.logsigmoid(-logits)
    return log_p.exp() * (log_p - math.log1p(-eps)) + log_q.exp() * (log_q - math.log(eps))
