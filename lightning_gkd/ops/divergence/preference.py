"""Preference losses over sequence log-probabilities (DPO and TRL 1.16's other pairwise losses), and the sequence
log-probabilities themselves. Pure torch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.divergence.jsd import to_compute_dtype

__all__ = [
    "PREFERENCE_LOSS_TYPES",
    "SMOOTHED_LOSS_TYPES",
    "check_preference_args",
    "preference_loss",
    "sequence_logps",
    "unused_label_smoothing",
]

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
    picked = to_compute_dtype(logits.gather(-1, targets).squeeze(-1))
    # One row at a time keeps the float32 copy of half-precision logits at (T, V).
    log_norm = torch.stack([torch.logsumexp(to_compute_dtype(row), dim=-1) for row in logits])
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
