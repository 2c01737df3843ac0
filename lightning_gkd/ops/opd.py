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
weighted estimate of the reverse KL (k1) when ``γ = 0``.

Only the sampled token's log-probs are needed from the teacher and the sampler, and the student's come from its
hidden states ``chunk_size`` positions at a time (``ops.chunked_head``), so no B × T × V logits exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_gkd.ops.chunked_head import check_hidden_and_head, check_token_ids, folded_head_loss, head_logits
from lightning_gkd.ops.hf import LogitHead

__all__ = ["OPDStats", "discounted_returns", "policy_gradient_distillation_loss"]


@dataclass(frozen=True)
class OPDStats:
    """What a batch's OPD loss saw (detached 0-dim tensors): the mean reward ``r``, the mean importance weight, the
    largest, and the fraction of tokens whose weight was truncated at ``w_max``."""

    mean_reward: torch.Tensor
    mean_weight: torch.Tensor
    max_weight: torch.Tensor
    truncated_fraction: torch.Tensor


def discounted_returns(rewards: torch.Tensor, rows: torch.Tensor, gamma: float) -> torch.Tensor:
    """``A_t = Σ_{j ≥ t, same row} γ^{j − t} r_j`` for ``rewards`` ``(N,)`` listed row-major, ``rows`` ``(N,)`` the
    row of each (non-decreasing). ``gamma = 0`` returns ``rewards``."""
    if gamma == 0:
        return rewards
    if rows.shape != rewards.shape:
        raise ValueError(f"rows {tuple(rows.shape)} must match rewards {tuple(rewards.shape)}.")
    if rewards.numel() == 0:
        return rewards
    rows = rows.to(rewards.device)
    _, counts = torch.unique_consecutive(rows, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(rewards.numel(), device=rewards.device) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=rewards.device), counts)
    grid = rewards.new_zeros(counts.numel(), int(counts.max()) + 1)  # right-padded: one zero column past the end
    grid[group, column] = rewards
    for t in range(grid.shape[1] - 2, -1, -1):
        grid[:, t] += gamma * grid[:, t + 1]
    return grid[group, column]


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
    chunk_size: int = 256,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OPDStats]:
    """The OPD surrogate (module docstring) and its statistics.

    Args:
        student_hidden: ``(N, H)`` student final hidden states at the positions that predict ``tokens``.
        student_head: the student's ``LogitHead`` or its ``(V, H)`` weight.
        tokens: ``(N,)`` the sampled next tokens.
        teacher_logprobs: ``(N,)`` ``log p_T(x_t)`` (``TopKSignal.next_logprobs`` of any teacher).
        rows: ``(N,)`` each position's row, non-decreasing (needed for ``gamma > 0``).
        sampler_logprobs: ``(N,)`` ``log p_sampler(x_t)``, the log-prob each token was drawn with; None: the samples
            are the current student's (``w_t = 1``).
        gamma: discount of later rewards, in [0, 1].
        max_weight: ``w_max`` (> 0), the truncation of the importance weights.
        chunk_size: positions projected to logits at a time.
        num_items_in_batch: divide the sum over positions by this instead of ``N``.

    Returns:
        ``(loss, stats)``: a 0-dim float32 tensor whose value is ``mean(−w · A)`` and whose gradient is the
        surrogate's; ``OPDStats``.
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
    if gamma > 0 and rows is None:
        raise ValueError("gamma > 0 discounts over each row's later tokens: pass rows, the row of every position.")
    device = student_hidden.device
    ids = tokens.to(device=device, dtype=torch.long)
    student = _token_logprobs(student_hidden.detach(), head, ids, chunk_size)
    reward = teacher_logprobs.detach().to(device=device, dtype=torch.float32) - student
    advantage = discounted_returns(reward, rows if rows is not None else torch.zeros_like(ids), gamma)
    if sampler_logprobs is None:
        weight = torch.ones_like(student)
    else:
        weight = torch.exp(student - sampler_logprobs.detach().to(device=device, dtype=torch.float32))
    truncated = weight > max_weight
    weight = weight.clamp(max=max_weight)
    coefficient = -weight * advantage  # d loss / d log p_S(x_t), summed (divided by the normaliser later)
    value = coefficient.sum()

    def chunk_loss(logits: torch.Tensor, chunk: slice, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the value is the detached mean(−w·A); the gradient is that of Σ c_t · log_softmax(z_t)[x_t]
        loss = value if chunk.start == 0 else value.new_zeros(())
        if not need_grad:
            return loss, None
        c = coefficient[chunk].unsqueeze(-1)
        grad = torch.softmax(logits, dim=-1).mul_(-c)
        grad.scatter_add_(1, ids[chunk, None], c)
        return loss, grad

    loss = folded_head_loss(student_hidden, head, chunk_loss, chunk_size, normalizer) if n else value / normalizer
    stats = OPDStats(
        mean_reward=reward.mean() if n else reward.new_zeros(()),
        mean_weight=weight.mean() if n else weight.new_zeros(()),
        max_weight=weight.max() if n else weight.new_zeros(()),
        truncated_fraction=truncated.float().mean() if n else weight.new_zeros(()),
    )
    return loss, stats
