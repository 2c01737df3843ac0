"""Distances between two models' aligned next-token distributions over different vocabularies: ULD's sorted-probability
L1 (Boizard et al., *Towards Cross-Tokenizer Distillation*) and GOLD's hybrid (a generalized JSD on the columns whose
token strings both vocabularies hold, ULD on the rest). Per aligned group;
``lightning_gkd.ops.cross_tokenizer.aligned_row_loss`` combines them into a row's loss. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, cast

import torch
from torch.utils.checkpoint import checkpoint

from lightning_gkd.ops.cross_tokenizer.token_alignment import EPS
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss, generalized_jsd_terms

__all__ = [
    "MATCHED_DIVERGENCES",
    "hybrid_distance",
    "hybrid_terms",
    "hybrid_weights",
    "matched_vocabulary",
    "uld_distance",
]

#: How the hybrid's matched part is compared: ``"clamped"`` (TRL's: the generalized JSD applied to the matched
#: columns as they are, unnormalised, each probability clamped at 1e-8) or ``"renormalised"`` (the exact generalized
#: JSD between the matched columns renormalised to distributions).
MATCHED_DIVERGENCES = ("clamped", "renormalised")
# Elements of one [rows, V] sort per chunk (the sort's values and int64 indices come on top of the input).
_SORT_ELEMENTS = 1 << 25


# --------------------------------------------------------------------------- distances


def _by_row_chunks(
    fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], chunk_size: int | None
) -> torch.Tensor:
    """``fn`` over row chunks of ``tensors`` (each ``[G, *]``), concatenated. With more than one chunk and autograd
    on, each chunk is checkpointed: its sort buffers are freed after the forward and recomputed in the backward."""
    rows = tensors[0].size(0)
    width = max(t.size(-1) for t in tensors)
    if chunk_size is None:
        chunk_size = max(1, _SORT_ELEMENTS // max(width, 1))
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (rows per chunk), got {chunk_size!r}.")
    if rows <= chunk_size:
        return fn(*tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outputs = []
    for start in range(0, rows, chunk_size):
        chunk = [t[start : start + chunk_size] for t in tensors]
        if grad:
            outputs.append(cast(torch.Tensor, checkpoint(fn, *chunk, use_reentrant=False)))
        else:
            outputs.append(fn(*chunk))
    return torch.cat(outputs)


def _sorted_l1(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Σ_v |sort↓(s)_v − sort↓(t)_v| per row, the shorter side zero-padded (its missing entries count as 0)."""
    s = student.sort(dim=-1, descending=True).values
    t = teacher.sort(dim=-1, descending=True).values
    common = min(s.size(-1), t.size(-1))
    distance = (s[:, :common] - t[:, :common]).abs().sum(-1)
    longer = s if s.size(-1) > common else t
    return distance + longer[:, common:].abs().sum(-1)


def _check_pair(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> None:
    if student_probs.dim() != 2 or teacher_probs.dim() != 2 or student_probs.size(0) != teacher_probs.size(0):
        raise ValueError(
            "student_probs and teacher_probs must be [G, V_s] and [G, V_t] with the same number of aligned groups G, "
            f"got {tuple(student_probs.shape)} and {tuple(teacher_probs.shape)}."
        )


def uld_distance(
    student_probs: torch.Tensor, teacher_probs: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    r"""Universal Logit Distillation distance (Boizard et al., 2024) per aligned group.

    .. math::

        d_g = \sum_{v=1}^{\max(V_s, V_t)} \big| \mathrm{sort}_\downarrow(s_g)_v - \mathrm{sort}_\downarrow(t_g)_v \big|

    with the shorter vocabulary's sorted row padded with zeros: the L1 (for 1-D distributions sorted alike, the
    Wasserstein-1) distance between the two rows' sorted probabilities, which needs no mapping between
    vocabularies. Invariant to permuting either vocabulary; 0 when the sorted rows agree.

    Args:
        student_probs: ``[G, V_s]`` (merged) student probabilities per aligned group.
        teacher_probs: ``[G, V_t]`` teacher probabilities for the same groups.
        chunk_size: groups sorted at a time (default: about 2**25 elements per sort). With several chunks and
            autograd on, each chunk is recomputed in the backward instead of keeping its sort indices.

    Returns:
        ``[G]`` distances, in the inputs' dtype (TRL's per-row ULD value is their mean).
    """
    _check_pair(student_probs, teacher_probs)
    return _by_row_chunks(_sorted_l1, (student_probs, teacher_probs), chunk_size)


def matched_vocabulary(
    student_vocab: Mapping[str, int], teacher_vocab: Mapping[str, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token strings both vocabularies hold, as id pairs: ``(student_ids, teacher_ids)``, sorted by teacher id.

    The vocabularies are ``tokenizer.get_vocab()`` mappings (token string -> id); a string matches when the same
    string is a key of both (byte-level BPE spells a leading space ``Ġ``, SentencePiece ``▁``: such tokenizers match
    only each other's spelling). Pairs are one-to-one: where several strings share an id, the pair with the lowest
    teacher id, then the lowest student id, is kept.

    Returns:
        Two int64 tensors of the same length ``M`` (possibly 0).
    """
    shared = (token for token in teacher_vocab if token in student_vocab)
    pairs = sorted((int(teacher_vocab[token]), int(student_vocab[token])) for token in shared)
    student_seen: set[int] = set()
    teacher_seen: set[int] = set()
    student_ids: list[int] = []
    teacher_ids: list[int] = []
    for teacher_id, student_id in pairs:
        if teacher_id in teacher_seen or student_id in student_seen:
            continue
        teacher_seen.add(teacher_id)
        student_seen.add(student_id)
        teacher_ids.append(teacher_id)
        student_ids.append(student_id)
    return torch.tensor(student_ids, dtype=torch.long), torch.tensor(teacher_ids, dtype=torch.long)


def _matched_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD on (unnormalised) probability subsets clamped at 1e-8, summed per row."""
    return generalized_jsd_terms(student.clamp_min(EPS).log(), teacher.clamp_min(EPS).log(), beta).sum(-1)


def _renormalised_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """The exact generalized JSD between the rows renormalised to distributions (``generalized_jsd_loss`` on their
    logs, whose log-softmax renormalises)."""
    tiny = torch.finfo(student.dtype).tiny
    divergence = generalized_jsd_loss(
        student.clamp_min(tiny).log(), teacher.clamp_min(tiny).log(), beta=beta, reduction="none"
    )
    return divergence.sum(-1)


def _unmatched_columns(vocab: int, matched_ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(vocab, dtype=torch.bool, device=matched_ids.device)
    mask[matched_ids] = False
    return mask.nonzero().squeeze(-1)


def _check_matched_ids(ids: torch.Tensor, vocab: int, side: str) -> None:
    if ids.dim() != 1:
        raise ValueError(f"{side}_ids must be 1-D, got shape {tuple(ids.shape)}.")
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(
            f"{side}_ids holds ids in [{int(ids.min())}, {int(ids.max())}], outside the {side}'s {vocab} logit "
            f"columns: the {side} tokenizer's vocabulary is larger than its model's output. Pass the matched ids "
            "of tokens the model can predict (drop ids >= the logits' width)."
        )


def hybrid_terms(
    student_probs: torch.Tensor,
    teacher_probs: torch.Tensor,
    student_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    *,
    beta: float,
    matched_divergence: Literal["clamped", "renormalised"] = "clamped",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The two unweighted parts of GOLD's hybrid distance per aligned group: ``(matched, unmatched)``.

    With :math:`S^m_g = s_g[\text{student\_ids}]` and :math:`T^m_g = t_g[\text{teacher\_ids}]` (the columns of the
    token strings both vocabularies hold, paired) and :math:`S^u_g`, :math:`T^u_g` the other columns:

    - ``matched`` :math:`= \sum_m \ell_m(S^m_g, T^m_g)`, the generalized JSD(β) of ``generalized_jsd_loss``
      (β = 0 forward KL, 1 reverse KL). ``matched_divergence="clamped"`` (TRL's, the default) applies it to the
      columns as they are, not renormalised, with every probability clamped at 1e-8:
      :math:`\ell = \beta\, T (\log T - \log M) + (1 - \beta)\, S (\log S - \log M)`,
      :math:`M = \beta T + (1 - \beta) S` (β = 0: :math:`T(\log T - \log S)`; β = 1: :math:`S(\log S - \log T)`).
      On unnormalised rows the pure KLs (β ∈ {0, 1}) can be negative; 0 < β < 1 cannot.
      ``"renormalised"``: the exact generalized JSD between :math:`S^m_g / \sum S^m_g` and
      :math:`T^m_g / \sum T^m_g`, a true divergence, blind to how much mass lies outside the matched columns.
    - ``unmatched`` :math:`= \mathrm{uld}(S^u_g, T^u_g)` (``uld_distance``), or 0 when either side has no unmatched
      column (as TRL).

    Args:
        student_probs: ``[G, V_s]``; teacher_probs: ``[G, V_t]``.
        student_ids, teacher_ids: ``[M]`` int64 column pairs (``matched_vocabulary``), ids below ``V_s`` / ``V_t``.
        beta: in ``[0, 1]``.
        matched_divergence: ``"clamped"`` or ``"renormalised"``.
        chunk_size: as in ``uld_distance``.

    Returns:
        ``([G], [G])`` in the inputs' dtype.
    """
    _check_pair(student_probs, teacher_probs)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}.")
    if matched_divergence not in MATCHED_DIVERGENCES:
        raise ValueError(f"matched_divergence must be one of {MATCHED_DIVERGENCES}, got {matched_divergence!r}.")
    v_s, v_t = student_probs.size(-1), teacher_probs.size(-1)
    _check_matched_ids(student_ids, v_s, "student")
    _check_matched_ids(teacher_ids, v_t, "teacher")
    if student_ids.shape != teacher_ids.shape:
        raise ValueError(
            f"student_ids and teacher_ids must pair up, got {student_ids.numel()} and {teacher_ids.numel()} ids."
        )
    device = student_probs.device
    student_ids, teacher_ids = student_ids.to(device), teacher_ids.to(device)
    student_rest = _unmatched_columns(v_s, student_ids)
    teacher_rest = _unmatched_columns(v_t, teacher_ids)
    with_matched = student_ids.numel() > 0
    with_unmatched = student_rest.numel() > 0 and teacher_rest.numel() > 0
    divergence = _matched_jsd if matched_divergence == "clamped" else _renormalised_jsd

    def both(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        zero = student.new_zeros(student.size(0))
        matched = divergence(student[:, student_ids], teacher[:, teacher_ids], beta) if with_matched else zero
        unmatched = _sorted_l1(student[:, student_rest], teacher[:, teacher_rest]) if with_unmatched else zero
        return torch.stack([matched, unmatched], dim=-1)

    terms = _by_row_chunks(both, (student_probs, teacher_probs), chunk_size)
    return terms[:, 0], terms[:, 1]


def hybrid_weights(
    matched_count: int, teacher_vocab: int, matched_weight: float | None, unmatched_weight: float | None
) -> tuple[float, float]:
    if (matched_weight is None) != (unmatched_weight is None):
        raise ValueError(
            f"Set both matched_weight and unmatched_weight, or neither for the adaptive weights; got "
            f"matched_weight={matched_weight!r}, unmatched_weight={unmatched_weight!r}."
        )
    if matched_weight is None or unmatched_weight is None:
        adaptive = matched_count / max(1, teacher_vocab)
        return adaptive, 1.0 - adaptive
    return matched_weight, unmatched_weight


def hybrid_distance(
    student_probs: torch.Tensor,
    teacher_probs: torch.Tensor,
    student_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    *,
    beta: float,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
    matched_divergence: Literal["clamped", "renormalised"] = "clamped",
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""GOLD's hybrid distance per aligned group: a generalized JSD on the columns of the token strings both
    vocabularies hold, ULD on the rest.

    .. math::

        d_g = w_m \cdot \mathrm{JSD}_\beta(S^m_g, T^m_g) + w_u \cdot \mathrm{uld}(S^u_g, T^u_g)

    (the two terms of ``hybrid_terms``). The weights default to TRL's adaptive ones, :math:`w_m = M / V_t` (the
    matched share of the teacher's ``V_t`` logit columns) and :math:`w_u = 1 - w_m`. With identical vocabularies
    (every column matched, ``M = V``) it is ``generalized_jsd_loss`` per position. Equal to TRL's
    ``ULDLoss._compute_hybrid_uld_loss`` on one group.

    Args:
        student_probs: ``[G, V_s]``; teacher_probs: ``[G, V_t]``.
        student_ids, teacher_ids: ``[M]`` column pairs from ``matched_vocabulary``.
        beta: the JSD's β in ``[0, 1]``.
        matched_weight, unmatched_weight: both or neither (None: adaptive).
        matched_divergence: ``"clamped"`` (TRL's) or ``"renormalised"``; see ``hybrid_terms``.
        chunk_size: as in ``uld_distance``.

    Returns:
        ``[G]`` distances.
    """
    w_m, w_u = hybrid_weights(teacher_ids.numel(), teacher_probs.size(-1), matched_weight, unmatched_weight)
    matched, unmatched = hybrid_terms(
        student_probs,
        teacher_probs,
        student_ids,
        teacher_ids,
        beta=beta,
        matched_divergence=matched_divergence,
        chunk_size=chunk_size,
    )
    return w_m * matched + w_u * unmatched
