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

A chunk's probability says which text the teacher prefers, not where else the mass should go. The ``projected`` loss
adds, at every student token, the teacher's distribution over the student's *next token*
(``projected_teacher_targets``: read off the teacher's distributions along its own tokenization, one teacher token
back) compared with the student's by the generalized JSD (``projected_distance``).

Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from lightning_gkd.ops.losses import generalized_jsd_loss, generalized_jsd_terms

__all__ = [
    "LOG_PROB_CEILING",
    "binary_jsd",
    "chunk_log_likelihoods",
    "log1mexp",
    "projected_distance",
    "projected_teacher_targets",
]

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

    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    return generalized_jsd_terms(
        two_outcomes(student_logp), two_outcomes(teacher_logp.to(student_logp.dtype)), beta
    ).sum(-1)


def _project(probs: torch.Tensor, token_map: torch.Tensor, student_vocab: int) -> torch.Tensor:
    """``[R, V_T]`` teacher probabilities onto ``[R, V_S]`` student columns through ``token_map`` (-1: dropped)."""
    columns = min(probs.size(-1), token_map.numel())
    mapped = token_map[:columns].to(probs.device)
    keep = mapped >= 0
    out = probs.new_zeros(probs.size(0), student_vocab)
    return out.index_add_(1, mapped[keep], probs[:, :columns][:, keep])


def projected_teacher_targets(
    teacher_probs: torch.Tensor,
    teacher_ids: Sequence[int],
    teacher_spans: Sequence[Sequence[int]],
    student_starts: Sequence[int],
    *,
    student_vocab: int,
    first_token: torch.Tensor,
    token_bytes: Sequence[bytes | None],
    extensions: Mapping[bytes, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The teacher's distribution over the student's next token at each student token's start, from the teacher's
    distributions along its own tokenization of the same text.

    At byte ``b`` (where a student token starts), let teacher token ``k`` be the one holding byte ``b - 1``, starting
    at byte ``a``. The teacher reached ``b`` either inside a longer token (every teacher token ``c`` that extends the
    bytes ``[a, b)`` puts :math:`T_k(c)` on the student token its remaining bytes start with: ``extensions``), or, when
    ``k`` ends at ``b``, by ending token ``k`` there and going on: :math:`T_k(t_k)\,T_{k+1}(c)` on the student token
    ``c``'s text starts with (``first_token``). At ``b = 0`` it is the teacher's first distribution, projected. This
    keeps what the teacher's own tokenization implies out of the target: after ``"78"``, ``"7"`` a BPE teacher that
    writes ``"7871"`` as ``"78"``, ``"71"`` puts its mass for the next byte ``"1"`` on ``"71"`` at the previous
    position, which the ending-and-going-on term alone would miss (it would say the answer ends). The rest of the
    teacher's ways to tokenize the text are left out (one token back).

    Args:
        teacher_probs: ``[N_t, V_T]``; row ``k`` is the distribution for teacher token ``k``.
        teacher_ids, teacher_spans: the teacher's ``N_t`` token ids and byte spans (end tokens zero-width).
        student_starts: the byte where each student position's token starts.
        student_vocab: ``V_S``.
        first_token, token_bytes, extensions: ``data.token_projection.projection_tables``.

    Returns:
        ``(positions, targets)``: the student positions that have a target (int64 ``[P]``) and the targets
        (``[P, V_S]``, rows summing to 1). A position without teacher mass (nothing maps) has none; of several
        zero-width student tokens at the same byte only the first has one.
    """
    n_t = teacher_probs.size(0)
    a_rows, a_cols, a_teacher_rows, a_teacher_cols = [], [], [], []
    b_rows, b_here, b_next, b_token = [], [], [], []
    previous = None
    cursor, n_spans = 0, len(teacher_spans)
    for p, b in enumerate(student_starts):
        if b == previous:  # a second zero-width token at the same byte (ChatML's "\n" after the EOS)
            continue
        previous = b
        if b == 0:
            if n_t:
                b_rows.append(p)
                b_here.append(-1)
                b_next.append(0)
                b_token.append(-1)
            continue
        # the teacher token holding byte b - 1: the first to end at or after b (spans are in order and student starts
        # only grow, so the cursor only moves forward)
        while cursor < n_spans and teacher_spans[cursor][1] < b:
            cursor += 1
        if cursor == n_spans or teacher_spans[cursor][0] >= b:
            continue
        k = cursor
        start, end = teacher_spans[k]
        raw = token_bytes[teacher_ids[k]] if teacher_ids[k] < len(token_bytes) else None
        if raw is not None and (found := extensions.get(raw[: b - start])) is not None:
            ids, cols = found
            within = ids < teacher_probs.size(-1)
            a_rows += [p] * int(within.sum())
            a_cols.append(cols[within])
            a_teacher_rows += [k] * int(within.sum())
            a_teacher_cols.append(ids[within])
        if end == b and k + 1 < n_t:
            b_rows.append(p)
            b_here.append(k)
            b_next.append(k + 1)
            b_token.append(teacher_ids[k])
    device = teacher_probs.device
    targets = teacher_probs.new_zeros(len(student_starts), student_vocab)
    if a_rows:
        values = teacher_probs[torch.tensor(a_teacher_rows, device=device), torch.cat(a_teacher_cols).to(device)]
        targets.index_put_((torch.tensor(a_rows, device=device), torch.cat(a_cols).to(device)), values, accumulate=True)
    if b_rows:
        projected = _project(teacher_probs[torch.tensor(b_next, device=device)], first_token, student_vocab)
        here = torch.tensor(b_here, device=device)
        scale = torch.where(
            here >= 0,
            teacher_probs[here.clamp_min(0), torch.tensor(b_token, device=device).clamp_min(0)],
            torch.ones_like(here, dtype=teacher_probs.dtype),
        )
        targets.index_add_(0, torch.tensor(b_rows, device=device), projected * scale[:, None])
    mass = targets.sum(-1)
    positions = torch.nonzero(mass > 0).squeeze(-1)
    return positions, targets[positions] / mass[positions, None]


def projected_distance(
    student_logits: torch.Tensor, targets: torch.Tensor, beta: float, student_temperature: float = 1.0
) -> torch.Tensor:
    """The generalized JSD (``beta``) between the student's distributions ``softmax(student_logits / τ)`` ``[P, V_S]``
    and ``targets`` ``[P, V_S]`` (``projected_teacher_targets``; zeros clamped at 1e-12), per row ``[P]``."""
    student_logits = student_logits if student_logits.dtype == torch.float64 else student_logits.float()
    teacher_log_probs = targets.to(student_logits.dtype).clamp_min(1e-12).log()
    per_token = generalized_jsd_loss(
        student_logits / student_temperature, teacher_log_probs, beta=beta, reduction="none"
    )
    return per_token.sum(-1)
