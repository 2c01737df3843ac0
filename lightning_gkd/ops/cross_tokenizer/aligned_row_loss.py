r"""Distillation between a student and a teacher with different tokenizers: Universal Logit Distillation (ULD) and
GOLD's hybrid loss, on completions aligned by UTF-8 byte spans.

Both models score the same completion *text*, each tokenized its own way. Every completion token carries a byte span
``(start, end)`` relative to the start of the completion's content (the text before the first EOS); end tokens (the
EOS and anything after it, such as ChatML's trailing ``"\n"``) are zero-width at ``(content_len, content_len)``.
``probs[k]`` is always a model's distribution *for* completion token ``k`` (from the logits of the position before
it, the usual shift).

One row's loss (``cross_tokenizer_row_terms``):

1. ``softmax(z_s / τ_s)`` and ``softmax(z_t / τ_t)`` over the completion positions; with ``skip_*_eos`` a side's
   trailing end tokens are dropped first.
2. Alignment. ``"bytes"``: ``align_byte_spans`` groups the two token sequences at the byte boundaries both
   tokenizers share (one student token to several teacher tokens, several to one, or several to several); group
   pairs with an empty side are dropped. ``"positions"``: token ``k`` of one side is paired with token ``k`` of the
   other, for the first ``min(N_s, N_t)`` tokens (the original ULD paper; TRL's ``use_extended_uld=False``).
3. ``merge_group_probs`` turns each group into one (unnormalised) distribution: the distribution at one position of
   the group times the probabilities the model gave the group's other actual tokens (the chain rule).
4. ``uld_distance`` (sorted-probability L1, vocabulary-free) or ``hybrid_distance`` (a generalized JSD on the
   columns whose token strings both vocabularies hold, ULD on the rest) per aligned group; or, with
   ``loss="likelihood"`` (not in TRL), steps 3-4 are replaced by each group's probability of its own text under both
   models compared as two-outcome distributions (``ops.chunk_likelihood``).

The row's loss is the mean of the returned per-group values (as in TRL); how rows are combined is the caller's.
``likelihood`` and ``projected`` run over a whole batch at once (``cross_tokenizer_batch_loss``: alignment, chunk
likelihoods and projection vectorised over all rows' tokens; the row functions call it with one row).

Parity and differences with TRL 1.16's ``trl.experimental.gold.gold_trainer.ULDLoss`` (the test oracle; values
agree within 1e-5 on the same inputs, see tests/test_ops_cross_tokenizer.py):

- ``merge="observed"``: TRL slices the logits *at* the completion positions, so its ``probs[k]`` is the model's
  distribution for token ``k + 1`` while the merged scalars read ``probs[j, id_j]``. Here ``probs[k]`` is the
  distribution for token ``k`` under both strategies (TRL's ``"bayesian"`` already shifts this way); the parity
  tests feed TRL logits shifted by one position so that its slice equals ours.
- ``skip_*_eos`` drops a side's trailing zero-width end tokens (all of them: ``<|im_end|>`` and ChatML's ``"\n"``);
  TRL drops the last supervised position of a row, whatever it is (a content token when a sample stopped at
  ``max_new_tokens`` without an EOS). Equal whenever a side has exactly one end token, and under ``"bytes"``
  alignment also with more (the extra end tokens form a tail group with an empty side, which both drop).
- Half-precision logits are upcast: softmax, merging and distances run in float32 (TRL: in the logits' dtype).
- Vocabularies without a shared token string give the hybrid weights (0, 1), i.e. plain ULD (TRL fails building
  its mapping); ``matched_vocabulary`` keeps matched pairs one-to-one.
- A merged group's product of token probabilities is computed as ``exp(Σ log)`` (the same value up to rounding).
- A row without an aligned group gives an empty tensor (no term), where TRL averages a 0 into its batch mean.
- Malformed spans, token ids outside the vocabulary and inconsistent lengths raise ``ValueError`` here.

Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Literal, NamedTuple

import torch

from lightning_gkd.ops.cross_tokenizer.chunk_likelihood import (
    ProjectionTables,
    binary_jsd,
    plan_targets,
    projected_distances,
    projection_plan,
)
from lightning_gkd.ops.cross_tokenizer.token_alignment import (
    MERGE_STRATEGIES,
    Span,
    align_byte_spans,
    align_flat_spans,
    end_token_count,
    merge_group_probs,
    token_id_list,
)
from lightning_gkd.ops.cross_tokenizer.uld import (
    MATCHED_DIVERGENCES,
    hybrid_distance,
    hybrid_terms,
    hybrid_weights,
    matched_vocabulary,
    uld_distance,
)

__all__ = [
    "ALIGNMENTS",
    "CROSS_TOKENIZER_LOSSES",
    "MATCHED_DIVERGENCES",
    "MERGE_STRATEGIES",
    "CrossTokenizerLoss",
    "CrossTokenizerTerms",
    "align_byte_spans",
    "cross_tokenizer_row_terms",
    "end_token_count",
    "hybrid_distance",
    "hybrid_terms",
    "matched_vocabulary",
    "merge_group_probs",
    "uld_distance",
]

CROSS_TOKENIZER_LOSSES = ("hybrid", "uld", "likelihood", "projected")
ALIGNMENTS = ("bytes", "positions")


# --------------------------------------------------------------------------- one row


@dataclass(frozen=True)
class CrossTokenizerLoss:
    """The settings of the cross-tokenizer loss (TRL's ``GOLDConfig`` name in brackets).

    Attributes:
        loss: ``"hybrid"`` (``uld_use_hybrid_loss=True``; needs the matched vocabulary), ``"uld"``, or
            ``"likelihood"`` (not in TRL: each aligned chunk's probability under both models, see
            ``ops.chunk_likelihood``; ``merge``, ``matched_*`` do not apply), or ``"projected"`` (not in TRL:
            ``"likelihood"`` plus, at every student token, the teacher's distribution over the student's next token
            (``ops.chunk_likelihood.projected_teacher_targets``), summed over the chunk; needs the projection
            tables).
        alignment: ``"bytes"`` (``use_extended_uld=True``: byte-span groups, merged) or ``"positions"``
            (``use_extended_uld=False``: token k with token k, no merging).
        merge: ``"observed"`` or ``"bayesian"`` (``uld_token_merge_strategy``); see ``merge_group_probs``.
        beta: the generalized JSD β in ``[0, 1]`` of the hybrid's exact part and of ``"likelihood"`` (``beta``).
        student_temperature, teacher_temperature: softmax temperatures, > 0 (``uld_*_temperature``).
        skip_student_eos, skip_teacher_eos: drop that side's end tokens (``uld_skip_*_eos``; TRL's default is True,
            ours False: a student whose end tokens are out of the loss is never taught to stop).
        matched_weight, unmatched_weight: the hybrid's weights, both or neither; None: adaptive
            (``uld_hybrid_*_weight``).
        matched_divergence: ``"clamped"`` (TRL's) or ``"renormalised"`` (not in TRL); see ``hybrid_terms``.
    """

    loss: Literal["hybrid", "uld", "likelihood", "projected"] = "projected"
    alignment: Literal["bytes", "positions"] = "bytes"
    merge: Literal["observed", "bayesian"] = "observed"
    beta: float = 0.5
    student_temperature: float = 1.0
    teacher_temperature: float = 1.0
    skip_student_eos: bool = False
    skip_teacher_eos: bool = False
    matched_weight: float | None = None
    unmatched_weight: float | None = None
    matched_divergence: Literal["clamped", "renormalised"] = "clamped"

    def __post_init__(self) -> None:
        choices = {
            "loss": CROSS_TOKENIZER_LOSSES,
            "alignment": ALIGNMENTS,
            "merge": MERGE_STRATEGIES,
            "matched_divergence": MATCHED_DIVERGENCES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"cross_tokenizer.{name} must be one of {allowed}, got {value!r}.")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(
                f"cross_tokenizer.beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {self.beta!r}."
            )
        for name in ("student_temperature", "teacher_temperature"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"cross_tokenizer.{name} must be a finite number > 0, got {value!r}.")
        if (self.matched_weight is None) != (self.unmatched_weight is None):
            raise ValueError(
                "cross_tokenizer.matched_weight and cross_tokenizer.unmatched_weight go together: set both, or "
                f"neither for the adaptive weights (matched share of the teacher's vocabulary); got "
                f"matched_weight={self.matched_weight!r}, unmatched_weight={self.unmatched_weight!r}."
            )
        if self.matched_weight is not None and self.loss != "hybrid":
            raise ValueError(
                f"cross_tokenizer.matched_weight / unmatched_weight weigh the hybrid loss's two parts; with "
                f"loss={self.loss!r} they have no effect. Set loss=hybrid or leave both null."
            )
        for name in ("matched_weight", "unmatched_weight"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"cross_tokenizer.{name} must be a finite number >= 0 (or null), got {value!r}.")


class CrossTokenizerTerms(NamedTuple):
    """One row's per-group values: ``loss`` ``[G]`` and, for the hybrid, its unweighted ``matched`` and
    ``unmatched`` parts ``[G]`` (None for ULD)."""

    loss: torch.Tensor
    matched: torch.Tensor | None
    unmatched: torch.Tensor | None


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.softmax(logits, dim=-1)


def _check_side(logits: torch.Tensor, ids: list[int], spans: Sequence[Span], side: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{side}_logits must be [N, V] (one row's completion positions), got {tuple(logits.shape)}.")
    if not len(ids) == len(spans) == logits.size(0):
        raise ValueError(
            f"{side}: {logits.size(0)} logit rows, {len(ids)} token ids and {len(spans)} byte spans; each completion "
            f"token needs one of each (logits shifted: row k is the distribution for token k)."
        )


def cross_tokenizer_row_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_ids: Sequence[int] | torch.Tensor,
    teacher_ids: Sequence[int] | torch.Tensor,
    student_spans: Sequence[Span],
    teacher_spans: Sequence[Span],
    *,
    settings: CrossTokenizerLoss,
    matched: tuple[torch.Tensor, torch.Tensor] | None,
    chunk_size: int | None = None,
    projection: ProjectionTables | None = None,
) -> CrossTokenizerTerms:
    """The cross-tokenizer distance of one row's completion, per aligned group (the module docstring's steps 1-4).

    Args:
        student_logits: ``[N_s, V_s]``, shifted: row ``k`` gives the distribution for completion token ``k``.
        teacher_logits: ``[N_t, V_t]``, the same for the teacher's tokenization of the same text.
        student_ids, teacher_ids: the ``N_s`` / ``N_t`` completion token ids.
        student_spans, teacher_spans: their UTF-8 byte spans relative to the content's start, end tokens
            zero-width at the content's end. Also needed with ``alignment="positions"``: they mark the end tokens.
        settings: the ``CrossTokenizerLoss``.
        matched: ``matched_vocabulary(...)`` (required for ``loss="hybrid"``; ignored for ``"uld"``), on any device.
        chunk_size: groups sorted at a time (see ``uld_distance``).
        projection: ``projection_tables(student_tokenizer, teacher_tokenizer)`` (``data.token_projection``; required
            for ``loss="projected"``).

    Returns:
        ``CrossTokenizerTerms``: ``loss`` ``[G]`` per aligned group (``G`` may be 0), float32 for half-precision
        logits, else the logits' dtype (TRL's row loss is ``.loss.mean()``; differentiable with respect to both
        logits), and for the hybrid its unweighted ``matched`` and ``unmatched`` parts (for logging).
    """
    s_ids, t_ids = token_id_list(student_ids), token_id_list(teacher_ids)
    _check_side(student_logits, s_ids, student_spans, "student")
    _check_side(teacher_logits, t_ids, teacher_spans, "teacher")
    if settings.loss == "hybrid" and matched is None:
        raise ValueError(
            "cross_tokenizer.loss='hybrid' needs the matched vocabulary: pass matched=matched_vocabulary("
            "student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()), or use loss='uld'."
        )
    n_s, n_t = len(s_ids), len(t_ids)
    if settings.skip_student_eos:
        n_s -= end_token_count(student_spans)
    if settings.skip_teacher_eos:
        n_t -= end_token_count(teacher_spans)

    if settings.alignment == "bytes":
        s_groups, t_groups = align_byte_spans(student_spans[:n_s], teacher_spans[:n_t])
        pairs = [(sg, tg) for sg, tg in zip(s_groups, t_groups, strict=True) if sg and tg]
    else:
        pairs = [([k], [k]) for k in range(min(n_s, n_t))]
    if settings.loss in ("likelihood", "projected"):
        return CrossTokenizerTerms(
            cross_tokenizer_batch_loss(
                student_logits,
                teacher_logits,
                [s_ids],
                [t_ids],
                [student_spans],
                [teacher_spans],
                settings=settings,
                projection=projection,
            ),
            None,
            None,
        )
    if settings.alignment == "bytes":
        s_probs = _probs(student_logits[:n_s], settings.student_temperature)
        t_probs = _probs(teacher_logits[:n_t], settings.teacher_temperature)
        s_aligned = merge_group_probs(s_probs, [sg for sg, _ in pairs], s_ids[:n_s], settings.merge)
        t_aligned = merge_group_probs(t_probs, [tg for _, tg in pairs], t_ids[:n_t], settings.merge)
    else:
        n = min(n_s, n_t)
        s_aligned = _probs(student_logits[:n], settings.student_temperature)
        t_aligned = _probs(teacher_logits[:n], settings.teacher_temperature)

    if settings.loss == "uld":
        return CrossTokenizerTerms(uld_distance(s_aligned, t_aligned, chunk_size=chunk_size), None, None)
    assert matched is not None
    student_matched, teacher_matched = matched
    w_m, w_u = hybrid_weights(
        teacher_matched.numel(), t_aligned.size(-1), settings.matched_weight, settings.unmatched_weight
    )
    matched_part, unmatched_part = hybrid_terms(
        s_aligned,
        t_aligned,
        student_matched,
        teacher_matched,
        beta=settings.beta,
        matched_divergence=settings.matched_divergence,
        chunk_size=chunk_size,
    )
    return CrossTokenizerTerms(w_m * matched_part + w_u * unmatched_part, matched_part, unmatched_part)


def _flat_side(
    logits: torch.Tensor,
    ids: Sequence[Sequence[int] | torch.Tensor],
    spans: Sequence[Sequence[Span]],
    skip_end_tokens: bool,
    side: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One side's rows flat (``[N]`` over all rows): the kept positions (indices into ``logits``, end tokens dropped
    with ``skip_end_tokens``), and their ids, ``[K, 2]`` spans and rows. Checks the shapes and spans."""
    device = logits.device
    if logits.dim() != 2:
        raise ValueError(f"{side}_logits must be [N, V] (the rows' completion positions), got {tuple(logits.shape)}.")
    lengths = [len(row) for row in ids]
    span_lengths = [len(row) for row in spans]
    if lengths != span_lengths or sum(lengths) != logits.size(0):
        raise ValueError(
            f"{side}: {logits.size(0)} logit rows, {sum(lengths)} token ids and {sum(span_lengths)} byte spans (per "
            f"row {lengths} ids and {span_lengths} spans); each completion token needs one of each (logits shifted: "
            "row k is the distribution for token k)."
        )
    flat_ids = torch.tensor(
        list(chain.from_iterable(row.tolist() if isinstance(row, torch.Tensor) else row for row in ids)),
        dtype=torch.long,
    ).to(device)
    flat_spans = torch.tensor(list(chain.from_iterable(spans)), dtype=torch.long).reshape(-1, 2).to(device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    if flat_ids.numel():
        bad = (flat_spans[:, 0] < 0) | (flat_spans[:, 0] > flat_spans[:, 1])
        back = torch.zeros_like(bad)
        back[1:] = (flat_spans[1:, 1] < flat_spans[:-1, 1]) & (rows[1:] == rows[:-1])
        if bool((bad | back).any()):
            k = int(torch.nonzero(bad | back)[0])
            raise ValueError(
                f"{side}_spans: token {k} (flat over the rows) has span {tuple(flat_spans[k].tolist())}; byte spans "
                "need 0 <= start <= end, and ends that never go back within a row (UTF-8 byte offsets relative to "
                "the start of the completion's content, end tokens zero-width at its end)."
            )
    keep = torch.ones_like(flat_ids, dtype=torch.bool)
    if skip_end_tokens and flat_ids.numel():  # the trailing zero-width tokens at each row's content end
        count = len(lengths)
        content = torch.zeros(count, dtype=torch.long, device=device).scatter_reduce(
            0, rows, flat_spans[:, 1], "amax", include_self=True
        )
        end = (flat_spans[:, 0] == content[rows]) & (flat_spans[:, 1] == content[rows])
        index = torch.arange(flat_ids.numel(), device=device)
        last_content = torch.full((count,), -1, dtype=torch.long, device=device).scatter_reduce(
            0, rows[~end], index[~end], "amax", include_self=True
        )
        keep = index <= last_content[rows]
    positions = torch.nonzero(keep).squeeze(-1)
    return positions, flat_ids[positions], flat_spans[positions], rows[positions]


def _token_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / τ)[ids]`` per row, float32 for half precision."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, ids[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def cross_tokenizer_batch_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_ids: Sequence[Sequence[int] | torch.Tensor],
    teacher_ids: Sequence[Sequence[int] | torch.Tensor],
    student_spans: Sequence[Sequence[Span]],
    teacher_spans: Sequence[Sequence[Span]],
    *,
    settings: CrossTokenizerLoss,
    projection: ProjectionTables | None = None,
    chunk_elements: int = 1 << 24,
) -> torch.Tensor:
    """The ``likelihood`` / ``projected`` loss of a batch, per aligned group, vectorised over the tokens of all rows:
    equal to concatenating ``cross_tokenizer_row_terms(...).loss`` over the rows.

    Args:
        student_logits: ``[Σ N_s, V_S]``: the rows' completion positions, row after row (shifted).
        teacher_logits: ``[Σ N_t, V_T]``, the same for the teacher.
        student_ids, teacher_ids: per row, the completion token ids.
        student_spans, teacher_spans: per row, their byte spans (see ``cross_tokenizer_row_terms``).
        settings: the ``CrossTokenizerLoss`` (``loss`` ``likelihood`` or ``projected``).
        projection: the ``ProjectionTables`` (required for ``projected``).
        chunk_elements: the projected part runs over chunks of about this many logits (positions × ``V_S``): the
            teacher's probabilities, the targets and the divergence's intermediates exist a chunk at a time.

    Returns:
        ``[G]`` over the rows' aligned groups in order, float32 for half-precision logits, else the logits' dtype;
        differentiable with respect to ``student_logits`` (and ``teacher_logits`` through the chunk likelihoods).
    """
    if settings.loss not in ("likelihood", "projected"):
        raise ValueError(
            f"cross_tokenizer_batch_loss computes loss='likelihood' or 'projected', got {settings.loss!r}."
        )
    if settings.loss == "projected" and projection is None:
        raise ValueError(
            "cross_tokenizer.loss='projected' needs the projection tables: pass projection=projection_tables("
            "student_tokenizer, teacher_tokenizer) (data/token_projection.py)."
        )
    if len(student_ids) != len(teacher_ids):
        raise ValueError(f"{len(student_ids)} student rows and {len(teacher_ids)} teacher rows: pass one of each.")
    s_pos, s_ids, s_spans, s_rows = _flat_side(
        student_logits, student_ids, student_spans, settings.skip_student_eos, "student"
    )
    t_pos, t_ids, t_spans, t_rows = _flat_side(
        teacher_logits, teacher_ids, teacher_spans, settings.skip_teacher_eos, "teacher"
    )
    for name, logits, ids in (("student", student_logits, s_ids), ("teacher", teacher_logits, t_ids)):
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < logits.size(-1)):
            raise ValueError(
                f"{name} token ids hold ids in [{int(ids.min())}, {int(ids.max())}], outside the {logits.size(-1)} "
                "logit columns."
            )
    device = student_logits.device
    if settings.alignment == "bytes":
        s_group, t_group, groups = align_flat_spans(s_spans[:, 1], s_rows, t_spans[:, 1], t_rows)
    else:  # token k with token k, for the first min(N_s, N_t) of each row
        rows = len(student_ids)
        n_s = torch.bincount(s_rows, minlength=rows)
        n_t = torch.bincount(t_rows, minlength=rows)
        paired = torch.minimum(n_s, n_t)
        offset = torch.cumsum(paired, 0) - paired
        groups = int(paired.sum())

        def numbered(rows_: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            local = torch.arange(rows_.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[rows_]
            return torch.where(local < paired[rows_], offset[rows_] + local, -1)

        s_group, t_group = numbered(s_rows, n_s), numbered(t_rows, n_t)
    s_in, t_in = s_group >= 0, t_group >= 0
    s_logp = _token_log_probs(student_logits[s_pos], s_ids, settings.student_temperature)
    t_logp = _token_log_probs(teacher_logits[t_pos], t_ids, settings.teacher_temperature)
    student_chunks = s_logp.new_zeros(groups).index_add(0, s_group[s_in], s_logp[s_in])
    teacher_chunks = t_logp.new_zeros(groups).index_add(0, t_group[t_in], t_logp[t_in])
    chunks = binary_jsd(student_chunks, teacher_chunks, settings.beta)
    if settings.loss == "likelihood":
        return chunks
    assert projection is not None
    tables = projection if projection.device == device else projection.to(device)
    t_logits = teacher_logits.detach()
    plan = projection_plan(
        t_ids,
        t_spans,
        t_rows,
        s_spans[:, 0],
        s_rows,
        teacher_vocab=t_logits.size(-1),
        tables=tables,
    )

    def teacher_probs(lo: int, hi: int) -> torch.Tensor:
        return _probs(t_logits[t_pos[lo:hi]], settings.teacher_temperature)

    per_position = projected_distances(
        student_logits,
        s_pos,
        lambda rows: plan_targets(
            plan, teacher_probs, rows, student_vocab=student_logits.size(-1), first_token=tables.first_token
        ),
        beta=settings.beta,
        temperature=settings.student_temperature,
        chunk_size=max(1, chunk_elements // max(student_logits.size(-1), 1)),
    ).to(chunks.dtype)
    per_group = chunks.new_zeros(groups).index_add(0, s_group[s_in], per_position[s_in])
    return per_group + chunks
