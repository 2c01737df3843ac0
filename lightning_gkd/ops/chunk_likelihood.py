r"""Cross-tokenizer distillation by the likelihood of aligned chunks: both models score the same completion text, the
text is cut at the byte boundaries both tokenizations share (``align_byte_spans``), and each model's probability of
every chunk is compared, each as a two-outcome distribution (the chunk, or anything else).

Why: ULD's sorted-probability distance says nothing about *which* token carries the mass, and the hybrid's exact
part compares a token string's probability in both vocabularies as if it meant the same in both. Where the
tokenizations differ it does not: a BPE teacher that writes ``"58"`` as one token gives the single token ``"5"``
almost no probability, while a byte-level student must write ``"5"`` then ``"8"``; the hybrid then pushes the
student's correct ``"5"`` down. The probability of the chunk's *text* is comparable on both sides: the student's
``p("5") p("8" | "5")`` against the teacher's ``p("58")`` (its other tokenizations of the text, which a tokenizer never
produces, are left out).

For a chunk ``g`` with student tokens ``x`` and teacher tokens ``y`` (the chain rule, temperatures applied first):

.. math::

    \ell^S_g = \sum_{k \in g} \log \mathrm{softmax}(z^S_k / \tau_S)[x_k], \qquad
    \ell^T_g = \sum_{k \in g} \log \mathrm{softmax}(z^T_k / \tau_T)[y_k]

and the chunk's loss is the generalized JSD (β: 0 forward KL, 1 reverse KL) between the Bernoulli distributions
``(exp ℓ^S_g, 1 - exp ℓ^S_g)`` and ``(exp ℓ^T_g, 1 - exp ℓ^T_g)``. This is the binarised form of approximate
likelihood matching (Minixhofer et al., 2025, "Universal Cross-Tokenizer Distillation via Approximate Likelihood
Matching"); TRL's GOLD has no such loss. With identical tokenizers every chunk is one token and the loss is a
per-token binary divergence on the actual token's probability (not GKD's full-distribution JSD).

Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_gkd.ops.losses import generalized_jsd_loss

__all__ = ["LOG_PROB_CEILING", "binary_jsd", "chunk_log_likelihoods", "log1mexp", "projected_first_token_distance"]

#: The largest chunk log-probability used: log(1 - 1e-6). ``log(1 - p)`` at p = 1 is -inf, and its gradient grows as
#: 1 / (1 - p); a chunk the model is sure of is held at this probability instead.
LOG_PROB_CEILING = math.log1p(-1e-6)


def log1mexp(log_p: torch.Tensor) -> torch.Tensor:
    r"""``log(1 - exp(log_p))`` for ``log_p < 0``, accurate at both ends (Mächler, 2012): ``log(-expm1(x))`` for
    ``x > -log 2``, else ``log1p(-exp(x))``."""
    return torch.where(log_p > -math.log(2.0), torch.log(-torch.expm1(log_p)), torch.log1p(-torch.exp(log_p)))


def chunk_log_likelihoods(
    logits: torch.Tensor,
    groups: Sequence[Sequence[int]],
    token_ids: Sequence[int] | torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    r"""Each group's log-probability: :math:`\ell_g = \sum_{k \in g} \log \mathrm{softmax}(z_k / \tau)[x_k]`.

    Args:
        logits: ``[N, V]``, shifted: row ``k`` gives the distribution for token ``k``.
        groups: ``G`` lists of indices into the rows (from ``align_byte_spans``); an empty group gives 0.
        token_ids: the ``N`` actual token ids.
        temperature: softmax temperature, > 0.

    Returns:
        ``[G]`` log-probabilities, float32 for half-precision logits, else the logits' dtype; differentiable with
        respect to ``logits``.

    Raises:
        ValueError: ``token_ids`` of another length than ``N``, an id outside ``[0, V)`` or an index outside
            ``[0, N)``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}.")
    n, vocab = logits.shape
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device).reshape(-1)
    if ids.numel() != n:
        raise ValueError(f"token_ids has {ids.numel()} ids for {n} rows of logits; pass one id per row.")
    if n and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(
            f"token_ids hold ids in [{int(ids.min())}, {int(ids.max())}], outside the {vocab} logit columns."
        )
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    token_logps = logits.gather(-1, ids[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    owner, members = [], []
    for g, group in enumerate(groups):
        for k in group:
            if not 0 <= int(k) < n:
                raise ValueError(f"groups[{g}] holds position {int(k)}, outside the {n} rows of logits.")
            owner.append(g)
            members.append(int(k))
    sums = token_logps.new_zeros(len(groups))
    if members:
        index = torch.tensor(members, device=logits.device)
        sums = sums.index_add(0, torch.tensor(owner, device=logits.device), token_logps[index])
    return sums


def binary_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    r"""The generalized JSD between two Bernoulli distributions given by their log-probabilities of the event.

    With :math:`S = (e^{\ell_S}, 1 - e^{\ell_S})` and :math:`T = (e^{\ell_T}, 1 - e^{\ell_T})`: ``KL(T || S)`` for
    ``beta = 0``, ``KL(S || T)`` for ``beta = 1``, in between
    :math:`\beta\,KL(T \| M) + (1 - \beta)\,KL(S \| M)` with :math:`M = \beta T + (1 - \beta) S` (as
    ``generalized_jsd_loss``). Log-probabilities above ``LOG_PROB_CEILING`` are held at it (their gradient passes
    through).

    Args:
        student_logp, teacher_logp: ``[G]`` log-probabilities (<= 0) of the same events.
        beta: in ``[0, 1]``.

    Returns:
        ``[G]`` divergences (>= 0), differentiable with respect to both inputs.
    """
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(
            f"student_logp and teacher_logp must have one shape, got {tuple(student_logp.shape)} and "
            f"{tuple(teacher_logp.shape)}."
        )

    def two_outcomes(logp: torch.Tensor) -> torch.Tensor:
        # the value held at the ceiling, the gradient passed through (a sure student still hears the teacher)
        logp = logp - (logp - logp.clamp(max=LOG_PROB_CEILING)).detach()
        return torch.stack([logp, log1mexp(logp)], dim=-1)

    per_outcome = generalized_jsd_loss(
        two_outcomes(student_logp), two_outcomes(teacher_logp.to(student_logp.dtype)), beta=beta, reduction="none"
    )
    return per_outcome.sum(-1)


def projected_first_token_distance(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    token_map: torch.Tensor,
    beta: float,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
) -> torch.Tensor:
    r"""The generalized JSD between the student's distribution for a chunk's first token and the teacher's
    distribution there projected onto the student's vocabulary.

    At a chunk's start both tokenizations are at a token boundary of the same text, so the teacher's next-token
    distribution says where the text goes next: teacher token ``t`` puts its probability on the student token its
    text starts with, ``token_map[t]`` (``data.cross_tokenizer.first_token_map``); unmapped tokens (-1) are dropped and
    the rest renormalised: :math:`\tilde T_s = \sum_{t: m(t) = s} T_t / \sum_{t: m(t) \ge 0} T_t`.

    Args:
        student_logits: ``[G, V_S]``, the student's logits for each chunk's first token.
        teacher_logits: ``[G, V_T]``, the teacher's for its first token of the same chunk.
        token_map: int64, one entry per teacher token, values in ``[-1, V_S)``; teacher logit columns beyond it (a
            model's padded rows) are dropped.
        beta: in ``[0, 1]`` (0: forward KL, 1: reverse KL).
        student_temperature, teacher_temperature: softmax temperatures.

    Returns:
        ``[G]`` divergences, differentiable with respect to ``student_logits``.
    """
    if student_logits.size(0) != teacher_logits.size(0):
        raise ValueError(
            f"student_logits has {student_logits.size(0)} chunks, teacher_logits {teacher_logits.size(0)}."
        )
    student_logits = student_logits if student_logits.dtype == torch.float64 else student_logits.float()
    teacher_probs = torch.softmax(teacher_logits.to(student_logits.dtype) / teacher_temperature, dim=-1)
    columns = min(teacher_probs.size(-1), token_map.numel())
    mapped = token_map[:columns].to(teacher_probs.device)
    keep = mapped >= 0
    projected = teacher_probs.new_zeros(teacher_probs.size(0), student_logits.size(-1))
    projected.index_add_(1, mapped[keep], teacher_probs[:, :columns][:, keep])
    projected = projected / projected.sum(-1, keepdim=True).clamp_min(1e-12)
    teacher_log_probs = projected.clamp_min(1e-12).log()
    per_token = generalized_jsd_loss(
        student_logits / student_temperature, teacher_log_probs, beta=beta, reduction="none"
    )
    return per_token.sum(-1)
