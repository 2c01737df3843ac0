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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss, generalized_jsd_terms

__all__ = [
    "LOG_PROB_CEILING",
    "ProjectionPlan",
    "ProjectionTables",
    "binary_jsd",
    "chunk_log_likelihoods",
    "log1mexp",
    "plan_targets",
    "projected_distance",
    "projected_distances",
    "projected_teacher_targets",
    "projection_plan",
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


@dataclass(frozen=True)
class ProjectionTables:
    """What projecting a teacher's distributions onto a student's vocabulary reads, as flat tensors (built by
    ``data.token_projection.projection_tables``; ``from_parts`` from the plain mappings).

    Attributes:
        first_token: ``[V_T]`` int64: for each teacher token, the student token its text starts with (-1: none).
        token_length: ``[V_T]`` int64: each teacher token's length in bytes, -1 for a special (added) token.
        byte_offsets: ``[V_T + 1]`` int64: token ``t``'s bytes are ``token_data[byte_offsets[t]:byte_offsets[t+1]]``.
        token_data: ``[Σ len]`` uint8: the teacher tokens' bytes, concatenated.
        cut_prefix: ``[Σ len]`` int64: at ``byte_offsets[t] + c - 1`` (``1 <= c <= len``), the index of the prefix
            ``bytes(t)[:c]`` among the prefixes some teacher token extends (-1: none).
        extension_offsets: ``[P + 1]`` int64: prefix ``i``'s extensions are entries
            ``extension_offsets[i]:extension_offsets[i + 1]`` of
        extension_ids: ``[E]`` int64: the teacher tokens that extend the prefix, and
        extension_targets: ``[E]`` int64: the student token each one's remaining bytes start with (tokens whose
            remainder maps to none are left out).
    """

    first_token: torch.Tensor
    token_length: torch.Tensor
    byte_offsets: torch.Tensor
    token_data: torch.Tensor
    cut_prefix: torch.Tensor
    extension_offsets: torch.Tensor
    extension_ids: torch.Tensor
    extension_targets: torch.Tensor

    @classmethod
    def from_parts(
        cls,
        first_token: torch.Tensor,
        token_bytes: Sequence[bytes | None],
        extensions: Mapping[bytes, tuple[torch.Tensor | Sequence[int], torch.Tensor | Sequence[int]]],
    ) -> ProjectionTables:
        """The tables of ``first_token`` ``[V_T]``, each teacher token's bytes (None: special) and, for each proper
        prefix some teacher token extends, ``(extending teacher ids, their student targets)``."""
        prefixes = list(extensions)
        index = {prefix: i for i, prefix in enumerate(prefixes)}
        lengths = [-1 if raw is None else len(raw) for raw in token_bytes]
        data = b"".join(raw for raw in token_bytes if raw is not None)
        cut = [index.get(raw[:c], -1) for raw in token_bytes if raw is not None for c in range(1, len(raw) + 1)]

        def flat(part: int) -> list[int]:
            values = (extensions[prefix][part] for prefix in prefixes)
            return [i for v in values for i in (v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else v)]

        counts = [len(extensions[prefix][0]) for prefix in prefixes]
        ids, targets = flat(0), flat(1)
        offsets = torch.tensor([0, *[max(n, 0) for n in lengths]], dtype=torch.long).cumsum(0)
        return cls(
            first_token=first_token.to(torch.long),
            token_length=torch.tensor(lengths, dtype=torch.long),
            byte_offsets=offsets,
            token_data=torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.zeros(0, dtype=torch.uint8),
            cut_prefix=torch.tensor(cut, dtype=torch.long),
            extension_offsets=torch.tensor([0, *counts], dtype=torch.long).cumsum(0),
            extension_ids=torch.tensor(ids, dtype=torch.long),
            extension_targets=torch.tensor(targets, dtype=torch.long),
        )

    def to(self, device: torch.device | str) -> ProjectionTables:
        """The tables on ``device``."""
        return ProjectionTables(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def device(self) -> torch.device:
        return self.first_token.device

    def token_bytes(self, token: int) -> bytes | None:
        """Teacher token ``token``'s bytes (None: a special token)."""
        if int(self.token_length[token]) < 0:
            return None
        lo, hi = int(self.byte_offsets[token]), int(self.byte_offsets[token + 1])
        return bytes(self.token_data[lo:hi].tolist())

    def extending(self, prefix: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(teacher ids, student targets)`` of the tokens extending ``prefix`` (None: none); a linear scan, for
        inspection."""
        for token in range(self.token_length.numel()):
            raw = self.token_bytes(token)
            if raw is not None and len(raw) >= len(prefix) > 0 and raw.startswith(prefix):
                found = int(self.cut_prefix[int(self.byte_offsets[token]) + len(prefix) - 1])
                if found < 0:
                    return None
                lo, hi = int(self.extension_offsets[found]), int(self.extension_offsets[found + 1])
                return self.extension_ids[lo:hi], self.extension_targets[lo:hi]
        return None


def _project(probs: torch.Tensor, token_map: torch.Tensor, student_vocab: int) -> torch.Tensor:
    """``[R, V_T]`` teacher probabilities onto ``[R, V_S]`` student columns through ``token_map`` (-1: dropped)."""
    columns = min(probs.size(-1), token_map.numel())
    mapped = token_map[:columns].to(probs.device)
    keep = mapped >= 0
    out = probs.new_zeros(probs.size(0), student_vocab)
    return out.index_add_(1, mapped[keep], probs[:, :columns][:, keep])


class ProjectionPlan(NamedTuple):
    """Which teacher probabilities make each student position's projected target (``projection_plan``), over flat
    token indices of a batch. ``a_*`` (inside a longer teacher token): ``T[a_row, a_col]`` goes to student column
    ``a_target`` of position ``a_position``. ``b_*`` (ending teacher token ``b_here`` and going on):
    ``T[b_here, b_token] * project(T[b_next])`` goes to position ``b_position`` (``b_here = -1``: a factor of 1).
    Both are sorted by position."""

    a_position: torch.Tensor
    a_row: torch.Tensor
    a_col: torch.Tensor
    a_target: torch.Tensor
    b_position: torch.Tensor
    b_here: torch.Tensor
    b_token: torch.Tensor
    b_next: torch.Tensor


def _row_starts(rows: torch.Tensor) -> torch.Tensor:
    """For a flat tensor of non-decreasing row numbers, whether each entry is its row's first."""
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    return first


def projection_plan(
    teacher_ids: torch.Tensor,
    teacher_spans: torch.Tensor,
    teacher_rows: torch.Tensor,
    student_starts: torch.Tensor,
    student_rows: torch.Tensor,
    *,
    teacher_vocab: int,
    tables: ProjectionTables,
) -> ProjectionPlan:
    r"""The ``ProjectionPlan`` of a batch, vectorised over tokens (see ``projected_teacher_targets`` for the rule).

    Args:
        teacher_ids: ``[M]`` int64, the teacher's completion tokens of all rows, row after row.
        teacher_spans: ``[M, 2]`` their byte spans (in order within a row, end tokens zero-width).
        teacher_rows: ``[M]`` each token's row (non-decreasing).
        student_starts: ``[N]`` the byte where each student position's token starts, row after row.
        student_rows: ``[N]`` each position's row (non-decreasing).
        teacher_vocab: the teacher distributions' width (``V_T``): extensions beyond it are left out.
        tables: ``ProjectionTables`` (on the tokens' device).
    """
    device = student_starts.device
    shift = 40  # row << 40 | byte: one sorted key per (row, byte)
    t_first = _row_starts(teacher_rows)
    t_index = torch.arange(teacher_ids.numel(), device=device)
    row_count = int(
        max(
            int(student_rows.max()) + 1 if student_rows.numel() else 0,
            int(teacher_rows.max()) + 1 if teacher_rows.numel() else 0,
        )
    )
    first_of_row = torch.full((row_count,), -1, dtype=torch.long, device=device)
    first_of_row[teacher_rows[t_first]] = t_index[t_first]
    last_of_row = torch.full((row_count,), -1, dtype=torch.long, device=device)
    last_of_row.scatter_reduce_(0, teacher_rows, t_index, "amax")
    # a second zero-width student token at the same byte (ChatML's "\n" after the EOS) gets nothing
    s_first = _row_starts(student_rows)
    repeated = torch.zeros_like(s_first)
    repeated[1:] = (student_starts[1:] == student_starts[:-1]) & ~s_first[1:]
    live = ~repeated
    positions = torch.arange(student_starts.numel(), device=device)
    at_zero = live & (student_starts == 0) & (first_of_row[student_rows] >= 0)
    # the teacher token holding byte b - 1: the first of the row to end at or after b (the running maximum of b, as a
    # cursor that only moves forward)
    reached = torch.cummax((student_rows << shift) | student_starts, 0).values
    k = torch.searchsorted((teacher_rows << shift) | teacher_spans[:, 1], reached)
    inside = k < teacher_ids.numel()
    k = k.clamp(max=max(teacher_ids.numel() - 1, 0))
    if teacher_ids.numel():
        inside &= (teacher_rows[k] == student_rows) & (teacher_spans[k, 0] < student_starts)
    else:
        inside = torch.zeros_like(live)
    inside &= live & (student_starts > 0)
    held = k[inside]
    where = positions[inside]
    starts = student_starts[inside]
    token = teacher_ids[held] if teacher_ids.numel() else held
    vocab = tables.token_length.numel()
    known = token < vocab
    length = torch.where(known, tables.token_length[token.clamp(max=vocab - 1)], torch.full_like(token, -1))
    has_bytes = length >= 1
    cut = torch.minimum(starts - teacher_spans[held, 0], length.clamp_min(1)) if held.numel() else starts
    slot = tables.byte_offsets[token.clamp(max=vocab - 1)] + cut - 1
    prefix = (
        torch.where(has_bytes, tables.cut_prefix[slot.clamp(0, max(tables.cut_prefix.numel() - 1, 0))], -1)
        if tables.cut_prefix.numel()
        else torch.full_like(token, -1)
    )
    found = prefix >= 0
    lo = tables.extension_offsets[prefix[found]]
    counts = tables.extension_offsets[prefix[found] + 1] - lo
    entry_owner = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    entry = (
        lo[entry_owner] + torch.arange(entry_owner.numel(), device=device) - (counts.cumsum(0) - counts)[entry_owner]
    )
    a_col = tables.extension_ids[entry]
    within = a_col < teacher_vocab
    a_position = where[found][entry_owner][within]
    a_row = held[found][entry_owner][within]
    # ending the held token at b and going on with the next one of the row
    ends_here = (
        (teacher_spans[held, 1] == starts) & (held < last_of_row[student_rows[inside]])
        if held.numel()
        else torch.zeros_like(held, dtype=torch.bool)
    )
    b_mask = at_zero.clone()
    b_mask[where[ends_here]] = True
    b_here = torch.full_like(positions, -1)
    b_here[where[ends_here]] = held[ends_here]
    b_next = torch.where(at_zero, first_of_row[student_rows], b_here + 1)
    b_token = torch.full_like(positions, -1)
    b_token[where[ends_here]] = token[ends_here]
    return ProjectionPlan(
        a_position,
        a_row,
        a_col[within],
        tables.extension_targets[entry][within],
        positions[b_mask],
        b_here[b_mask],
        b_token[b_mask],
        b_next[b_mask],
    )


def plan_targets(
    plan: ProjectionPlan,
    teacher_probs: Callable[[int, int], torch.Tensor],
    positions: slice,
    *,
    student_vocab: int,
    first_token: torch.Tensor,
) -> torch.Tensor:
    """The unnormalised targets ``[C, V_S]`` of the student positions ``positions`` (a step-1 slice), reading teacher
    rows ``teacher_probs(lo, hi)`` (``[hi - lo, V_T]``, rows ``lo`` to ``hi - 1``) only where the plan needs them."""
    lo, hi = positions.start, positions.stop
    a = slice(*torch.searchsorted(plan.a_position, torch.tensor([lo, hi], device=plan.a_position.device)).tolist())
    b = slice(*torch.searchsorted(plan.b_position, torch.tensor([lo, hi], device=plan.b_position.device)).tolist())
    needed = torch.cat([plan.a_row[a], plan.b_next[b], plan.b_here[b][plan.b_here[b] >= 0]])
    probs_device = first_token.device
    if needed.numel() == 0:
        return torch.zeros(hi - lo, student_vocab, device=probs_device)
    t_lo, t_hi = int(needed.min()), int(needed.max()) + 1
    probs = teacher_probs(t_lo, t_hi)
    targets = probs.new_zeros(hi - lo, student_vocab)
    if a.stop > a.start:
        values = probs[plan.a_row[a] - t_lo, plan.a_col[a]]
        targets.index_put_((plan.a_position[a] - lo, plan.a_target[a]), values, accumulate=True)
    if b.stop > b.start:
        here = plan.b_here[b]
        projected = _project(probs[plan.b_next[b] - t_lo], first_token, student_vocab)
        scale = torch.where(
            here >= 0,
            probs[(here - t_lo).clamp_min(0), plan.b_token[b].clamp_min(0)],
            torch.ones_like(here, dtype=probs.dtype),
        )
        targets.index_add_(0, plan.b_position[b] - lo, projected * scale[:, None])
    return targets


def projected_teacher_targets(
    teacher_probs: torch.Tensor,
    teacher_ids: Sequence[int],
    teacher_spans: Sequence[Sequence[int]],
    student_starts: Sequence[int],
    *,
    student_vocab: int,
    tables: ProjectionTables,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The teacher's distribution over the student's next token at each student token's start, from the teacher's
    distributions along its own tokenization of the same text (one row; ``projection_plan`` and ``plan_targets``
    do it for a batch, a chunk of positions at a time).

    At byte ``b`` (where a student token starts), let teacher token ``k`` be the one holding byte ``b - 1``, starting
    at byte ``a``. The teacher reached ``b`` either inside a longer token (every teacher token ``c`` that extends the
    bytes ``[a, b)`` puts :math:`T_k(c)` on the student token its remaining bytes start with: the tables'
    extensions), or, when ``k`` ends at ``b``, by ending token ``k`` there and going on:
    :math:`T_k(t_k)\,T_{k+1}(c)` on the student token ``c``'s text starts with (``first_token``). At ``b = 0`` it is
    the teacher's first distribution, projected. This keeps what the teacher's own tokenization implies out of the
    target: after ``"78"``, ``"7"`` a BPE teacher that writes ``"7871"`` as ``"78"``, ``"71"`` puts its mass for the
    next byte ``"1"`` on ``"71"`` at the previous position, which the ending-and-going-on term alone would miss (it
    would say the answer ends). The rest of the teacher's ways to tokenize the text are left out (one token back).

    Args:
        teacher_probs: ``[N_t, V_T]``; row ``k`` is the distribution for teacher token ``k``.
        teacher_ids, teacher_spans: the teacher's ``N_t`` token ids and byte spans (end tokens zero-width).
        student_starts: the byte where each student position's token starts.
        student_vocab: ``V_S``.
        tables: ``ProjectionTables`` (``data.token_projection.projection_tables``).

    Returns:
        ``(positions, targets)``: the student positions that have a target (int64 ``[P]``) and the targets
        (``[P, V_S]``, rows summing to 1). A position without teacher mass (nothing maps) has none; of several
        zero-width student tokens at the same byte only the first has one.
    """
    device = teacher_probs.device
    tables = tables if tables.device == device else tables.to(device)
    n_t, n_s = teacher_probs.size(0), len(student_starts)
    spans = torch.as_tensor(teacher_spans, dtype=torch.long, device=device).reshape(-1, 2)[:n_t]
    plan = projection_plan(
        torch.as_tensor(teacher_ids, dtype=torch.long, device=device).reshape(-1)[:n_t],
        spans,
        torch.zeros(n_t, dtype=torch.long, device=device),
        torch.as_tensor(student_starts, dtype=torch.long, device=device).reshape(-1),
        torch.zeros(n_s, dtype=torch.long, device=device),
        teacher_vocab=teacher_probs.size(-1),
        tables=tables,
    )
    targets = plan_targets(
        plan,
        lambda lo, hi: teacher_probs[lo:hi],
        slice(0, n_s),
        student_vocab=student_vocab,
        first_token=tables.first_token,
    ).to(teacher_probs.dtype)
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


class _RowwiseDistances(torch.autograd.Function):
    """Per-row distances of ``logits`` rows, a chunk of rows at a time; each chunk's gradient is taken in the forward
    pass (a row's distance reads only its row) and its intermediates dropped."""

    @staticmethod
    def forward(ctx, logits, positions, distance, chunk_size):
        need_grad = logits.requires_grad
        out = torch.zeros(
            positions.numel(),
            dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32,
            device=logits.device,
        )
        grad = (
            torch.zeros((positions.numel(), logits.size(-1)), dtype=out.dtype, device=logits.device)
            if need_grad
            else None
        )
        for lo in range(0, positions.numel(), chunk_size):
            rows = slice(lo, min(lo + chunk_size, positions.numel()))
            x = logits[positions[rows]].detach().to(out.dtype)
            with torch.enable_grad():
                x.requires_grad_(need_grad)
                value = distance(x, rows)
                if need_grad and value.requires_grad:
                    (grad[rows],) = torch.autograd.grad(value.sum(), x)  # type: ignore[index]
            out[rows] = value.detach()
        ctx.save_for_backward(positions, grad if grad is not None else torch.empty(0))
        ctx.shape, ctx.dtype, ctx.need_grad = logits.shape, logits.dtype, need_grad
        return out

    @staticmethod
    def backward(ctx, grad_output):
        positions, grad = ctx.saved_tensors
        if not ctx.need_grad:
            return None, None, None, None
        full = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        full[positions] = (grad * grad_output[:, None]).to(ctx.dtype)  # positions are distinct rows
        return full, None, None, None


def projected_distances(
    student_logits: torch.Tensor,
    positions: torch.Tensor,
    targets: Callable[[slice], torch.Tensor],
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = 1 << 30,
) -> torch.Tensor:
    """``projected_distance`` at the rows ``positions`` of ``student_logits`` against ``targets(rows)`` (unnormalised
    ``[C, V_S]`` for the slice ``rows`` of ``positions``; a row without mass gives 0), ``chunk_size`` rows at a time:
    the targets, the student's probabilities and their gradient exist a chunk at a time (one ``[P, V_S]`` gradient
    is kept for the backward pass). Returns ``[P]``."""

    def distance(x: torch.Tensor, rows: slice) -> torch.Tensor:
        with torch.no_grad():
            chunk_targets = targets(rows)
            mass = chunk_targets.sum(-1)
        keep = torch.nonzero(mass > 0).squeeze(-1)
        out = x.new_zeros(x.size(0))
        if keep.numel():
            normalised = chunk_targets[keep] / mass[keep, None]
            out = out.index_put((keep,), projected_distance(x[keep], normalised, beta, temperature).to(x.dtype))
        return out

    return _RowwiseDistances.apply(student_logits, positions, distance, int(chunk_size))
