r"""On-policy distillation as a policy gradient (OPD): the teacher's log-prob of each sampled token is the reward.

On the student's own samples ``x_t``, the per-token reward is ``r_t = log p_T(x_t) − log p_S(x_t)`` (a stop-gradient
constant), the advantage its discounted sum over the rest of the completion, ``A_t = Σ_{j ≥ t} γ^{j − t} r_j``, and
the loss is the policy-gradient surrogate

    L = −(1 / N) Σ_t w_t · A_t · log p_S(x_t),        w_t = min(p_S(x_t) / p_sampler(x_t), w_max)   (stop-gradient)

whose gradient, with ``γ = 0`` and samples from the current student (``w_t = 1``), is ``(1/N) Σ_t (s_t − t_t) ∇s_t``:
in expectation over ``x ~ S``, exactly ``∇ KL(S‖T)`` (the score-function form; ``sparse_kd.sampled_kl_loss``'s k1).
``γ > 0`` credits a token with the teacher's verdict on what followed it. When the samples come from an older policy
(grouped generation, an engine synced every few steps), the truncated importance weight ``w_t`` corrects the
expectation (exactly while no weight reaches ``w_max``). The value returned is ``mean_t(−w_t · A_t)``: the importance-
weighted estimate of the reverse KL (k1) when ``γ = 0`` (and no option below is set).

Three options counter what goes wrong with ``γ > 0`` (defaults: off; ``token_advantages`` and the loss's docstring
give the formulas). The rewards are mostly negative, so the raw return ``A_t`` is the more negative the more tokens
follow ``t``: with ``γ = 1`` it favours short samples, and OPD collapses to short answers. ``length_normalize``
divides ``A_t`` by its number of (discounted) terms (MiniLLM), ``baseline="row"`` subtracts each row's mean
advantage, and ``clip_ratio`` replaces ``w_t · A_t`` with PPO's clipped surrogate for stale samples.

Only the sampled token's log-probs are needed from the teacher and the sampler, and the student's come from its
hidden states ``chunk_size`` positions at a time (``ops.chunked_head``), so no B × T × V logits exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_gkd.ops.divergence.chunked_head import (
    check_hidden_and_head,
    check_token_ids,
    folded_head_loss,
    head_logits,
)
from lightning_gkd.ops.hf.heads import LogitHead

__all__ = [
    "BASELINES",
    "Baseline",
    "OPDStats",
    "check_advantage_options",
    "discounted_returns",
    "policy_gradient_distillation_loss",
    "token_advantages",
]

#: What ``token_advantages`` subtracts from each token's advantage: nothing, or its row's mean advantage.
Baseline = Literal["none", "row"]
BASELINES: tuple[str, ...] = ("none", "row")


@dataclass(frozen=True)
class OPDStats:
    """What a batch's OPD loss saw (detached 0-dim tensors): the mean reward ``r``, the mean importance weight, the
    largest, the fraction of tokens whose weight was truncated at ``w_max``, the mean advantage ``A`` (after
    normalisation and baseline) and its mean absolute value, and, with ``clip_ratio``, the fraction of tokens whose
    gradient the clipping removed (else None)."""

    mean_reward: torch.Tensor
    mean_weight: torch.Tensor
    max_weight: torch.Tensor
    truncated_fraction: torch.Tensor
    mean_advantage: torch.Tensor
    mean_abs_advantage: torch.Tensor
    clipped_fraction: torch.Tensor | None = None


def _row_layout(rows: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``rows`` ``(N,)`` non-decreasing: each position's row index ``(N,)`` (0, 1, ... in order), its column
    within the row ``(N,)`` and the rows' lengths ``(R,)``."""
    rows = rows.to(device)
    _, counts = torch.unique_consecutive(rows, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(rows.numel(), device=device) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    return group, column, counts


def _check_rows(rows: torch.Tensor, rewards: torch.Tensor) -> None:
    if rows.shape != rewards.shape:
        raise ValueError(f"rows {tuple(rows.shape)} must match rewards {tuple(rewards.shape)}.")


def discounted_returns(rewards: torch.Tensor, rows: torch.Tensor, gamma: float) -> torch.Tensor:
    """``A_t = Σ_{j ≥ t, same row} γ^{j − t} r_j`` for ``rewards`` ``(N,)`` listed row-major, ``rows`` ``(N,)`` the
    row of each (non-decreasing). ``gamma = 0`` returns ``rewards``."""
    if gamma == 0:
        return rewards
    _check_rows(rows, rewards)
    if rewards.numel() == 0:
        return rewards
    group, column, counts = _row_layout(rows, rewards.device)
    grid = rewards.new_zeros(counts.numel(), int(counts.max()) + 1)  # right-padded: one zero column past the end
    grid[group, column] = rewards
    for t in range(grid.shape[1] - 2, -1, -1):
        grid[:, t] += gamma * grid[:, t + 1]
    return grid[group, column]


def check_advantage_options(*, length_normalize: bool, baseline: str, clip_ratio: float | None) -> None:
    """Raise ``ValueError`` naming the option, its value and what to set, for an invalid ``length_normalize``,
    ``baseline`` or ``clip_ratio`` (``policy_gradient_distillation_loss``'s; ``OPDModule`` checks them before any
    model loads)."""
    if not isinstance(length_normalize, bool):
        raise ValueError(f"length_normalize must be true or false, got {length_normalize!r}.")
    if baseline not in BASELINES:
        raise ValueError(
            f"baseline must be 'none' (the advantage as it is) or 'row' (minus its row's mean advantage), got "
            f"{baseline!r}."
        )
    if clip_ratio is not None and (
        not isinstance(clip_ratio, (int, float)) or isinstance(clip_ratio, bool) or not 0 < clip_ratio < 1
    ):
        raise ValueError(
            f"clip_ratio (PPO's ε: the ratio p_S / p_sampler is clipped to [1 − ε, 1 + ε]) must be in (0, 1), e.g. "
            f"0.2, or null for no clipping; got {clip_ratio!r}."
        )


def token_advantages(
    rewards: torch.Tensor,
    rows: torch.Tensor,
    gamma: float,
    *,
    length_normalize: bool = False,
    baseline: Baseline = "none",
) -> torch.Tensor:
    r"""The advantage of each token, ``(N,)`` in ``rewards``' dtype, from ``rewards`` ``(N,)`` listed row-major and
    ``rows`` ``(N,)`` the row of each (non-decreasing; rows may have different lengths). In three steps:

    1. the discounted return ``G_t = Σ_{j ≥ t, same row} γ^{j − t} r_j`` (``discounted_returns``);
    2. ``length_normalize``: ``G_t / Z_t`` with ``Z_t = Σ_{j ≥ t, same row} γ^{j − t}``, the discounted number of
       terms in ``G_t`` (MiniLLM's length normalisation): ``γ = 1`` gives the mean of the rewards from ``t`` to the
       row's end (``Z_t = L − t``, ``L`` the row's length, ``t`` from 0), ``0 < γ < 1`` a discounted mean
       (``Z_t = (1 − γ^{L − t}) / (1 − γ)``), ``γ = 0`` leaves ``r_t`` unchanged (``Z_t = 1``);
    3. ``baseline="row"``: minus the mean of step 2's values over the token's row, ``A_t − (1 / L) Σ_{j in row} A_j``.

    A row's mean is taken over its own tokens, token ``t`` included, so the baseline is not independent of the
    action it corrects: a variance reducer with a bias of order ``1 / L``. It removes what all of a row's advantages
    share: under ``length_normalize`` a constant offset of the rewards disappears completely (the mostly negative
    level of ``log p_T − log p_S``), and with it any signal saying that one whole sample was better than another:
    only the credit of tokens relative to the rest of their own row is left. Every row's advantages then sum to 0.
    """
    _check_rows(rows, rewards)
    advantage = discounted_returns(rewards, rows, gamma)
    if rewards.numel() == 0 or (baseline == "none" and not (length_normalize and gamma > 0)):
        return advantage
    group, column, counts = _row_layout(rows, rewards.device)
    if length_normalize and gamma > 0:
        remaining = (counts[group] - column).double()  # the terms j >= t of the token's row
        terms = remaining if gamma == 1 else -torch.expm1(remaining * math.log(gamma)) / (1.0 - gamma)
        advantage = advantage / terms.to(advantage.dtype)
    if baseline == "row":
        sums = advantage.new_zeros(counts.numel()).index_add_(0, group, advantage)
        advantage = advantage - (sums / counts.to(advantage.dtype))[group]
    return advantage


@torch.no_grad()
def _token_logprobs(hidden: torch.Tensor, head: LogitHead, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    out = []
    for start in range(0, hidden.shape[0], chunk_size):
        logits, _ = head_logits(hidden[start : start + chunk_size], head)
        chosen = logits.gather(-1, tokens[start : start + chunk_size, None]).squeeze(-1)
        out.append(chosen - torch.logsumexp(logits, dim=-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def policy_gradient_distillation_loss(
    student_hidden: torch.Tensor,
    student_head: LogitHead | torch.Tensor,
    tokens: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    gamma: float = 0.0,
    max_weight: float = 2.0,
    length_normalize: bool = False,
    baseline: Baseline = "none",
    clip_ratio: float | None = None,
    chunk_size: int = 256,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OPDStats]:
    """The OPD surrogate (module docstring) and its statistics.

    The advantages ``A_t`` are ``token_advantages(r, rows, gamma, length_normalize, baseline)``. With
    ``clip_ratio = ε`` the per-token surrogate is PPO's ``−min(ρ_t · A_t, clip(ρ_t, 1 − ε, 1 + ε) · A_t)``, the ratio
    ``ρ_t = w_t`` (``p_S / p_sampler``, truncated at ``max_weight`` as without clipping). Its gradient with respect
    to ``log p_S(x_t)`` is ``−ρ_t · A_t`` where the unclipped term is the minimum and 0 where the clipped one is
    (``A_t > 0`` and ``ρ_t > 1 + ε``, or ``A_t < 0`` and ``ρ_t < 1 − ε``): a token whose probability the student has
    already moved ``ε`` past the sampler's in the advantage's direction gets no further push. Where the clipping does
    not bound ``ρ_t`` (``A_t < 0``, ``ρ_t > 1 + ε``) ``max_weight`` still does, as in dual-clip PPO.

    Args:
        student_hidden: ``(N, H)`` student final hidden states at the positions that predict ``tokens``.
        student_head: the student's ``LogitHead`` or its ``(V, H)`` weight.
        tokens: ``(N,)`` the sampled next tokens.
        teacher_logprobs: ``(N,)`` ``log p_T(x_t)`` (``TopKSignal.next_logprobs`` of any teacher).
        rows: ``(N,)`` each position's row, non-decreasing (needed for ``gamma > 0`` and ``baseline='row'``).
        sampler_logprobs: ``(N,)`` ``log p_sampler(x_t)``, the log-prob each token was drawn with; None: the samples
            are the current student's (``w_t = 1``).
        gamma: discount of later rewards, in [0, 1].
        max_weight: ``w_max`` (> 0), the truncation of the importance weights.
        length_normalize: divide each return by its discounted number of terms (``token_advantages``).
        baseline: ``"row"``: subtract from each advantage its row's mean advantage (needs ``rows``); ``"none"``.
        clip_ratio: PPO's ``ε`` in (0, 1), or None: the importance-weighted surrogate ``−w_t · A_t`` unclipped.
        chunk_size: positions projected to logits at a time.
        num_items_in_batch: divide the sum over positions by this instead of ``N``.

    Returns:
        ``(loss, stats)``: a 0-dim float32 tensor whose value is the surrogate's mean, ``mean(−w · A)`` without
        clipping, and whose gradient is the surrogate's; ``OPDStats``.
    """
    head = student_head if isinstance(student_head, LogitHead) else LogitHead(student_head)
    normalizer = check_hidden_and_head(student_hidden, head, chunk_size, num_items_in_batch)
    n = student_hidden.shape[0]
    for name, value in (
        ("tokens", tokens),
        ("teacher_logprobs", teacher_logprobs),
        ("sampler_logprobs", sampler_logprobs),
    ):
        if value is not None and value.shape != (n,):
            raise ValueError(
                f"{name} must be (N,) = ({n},), the number of student_hidden rows; got {tuple(value.shape)}."
            )
    check_token_ids("tokens", tokens, head.weight.shape[0])
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}.")
    if not max_weight > 0:
        raise ValueError(f"max_weight must be > 0, got {max_weight}.")
    check_advantage_options(length_normalize=length_normalize, baseline=baseline, clip_ratio=clip_ratio)
    if gamma > 0 and rows is None:
        raise ValueError("gamma > 0 discounts over each row's later tokens: pass rows, the row of every position.")
    if baseline == "row" and rows is None:
        raise ValueError("baseline='row' subtracts each row's mean advantage: pass rows, the row of every position.")
    device = student_hidden.device
    ids = tokens.to(device=device, dtype=torch.long)
    student = _token_logprobs(student_hidden.detach(), head, ids, chunk_size)
    reward = teacher_logprobs.detach().to(device=device, dtype=torch.float32) - student
    advantage = token_advantages(
        reward,
        rows if rows is not None else torch.zeros_like(ids),
        gamma,
        length_normalize=length_normalize,
        baseline=baseline,
    )
    if sampler_logprobs is None:
        weight = torch.ones_like(student)
    else:
        weight = torch.exp(student - sampler_logprobs.detach().to(device=device, dtype=torch.float32))
    truncated = weight > max_weight
    weight = weight.clamp(max=max_weight)
    coefficient = -weight * advantage  # d loss / d log p_S(x_t), summed (divided by the normaliser later)
    clipped = None
    if clip_ratio is None:
        value = coefficient.sum()  # the surrogate −ρ·A (ρ = exp(log p_S − log p_sampler): d(ρA)/d log p_S = ρA)
    else:
        bounded = weight.clamp(1.0 - clip_ratio, 1.0 + clip_ratio) * advantage
        value = -torch.minimum(weight * advantage, bounded).sum()
        clipped = ((advantage > 0) & (weight > 1.0 + clip_ratio)) | ((advantage < 0) & (weight < 1.0 - clip_ratio))
        coefficient = coefficient.masked_fill(clipped, 0.0)

    def chunk_loss(logits: torch.Tensor, chunk: slice, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the value is the detached surrogate; the gradient is that of Σ c_t · log_softmax(z_t)[x_t]
        loss = value if chunk.start == 0 else value.new_zeros(())
        if not need_grad:
            return loss, None
        c = coefficient[chunk].unsqueeze(-1)
        grad = torch.softmax(logits, dim=-1).mul_(-c)
        grad.scatter_add_(1, ids[chunk, None], c)
        return loss, grad

    loss = folded_head_loss(student_hidden, head, chunk_loss, chunk_size, normalizer) if n else value / normalizer
    zero = weight.new_zeros(())
    stats = OPDStats(
        mean_reward=reward.mean() if n else zero,
        mean_weight=weight.mean() if n else zero,
        max_weight=weight.max() if n else zero,
        truncated_fraction=truncated.float().mean() if n else zero,
        mean_advantage=advantage.mean() if n else zero,
        mean_abs_advantage=advantage.abs().mean() if n else zero,
        clipped_fraction=(clipped.float().mean() if n else zero) if clipped is not None else None,
    )
    return loss, stats
