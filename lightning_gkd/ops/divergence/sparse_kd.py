r"""Distillation losses from a *sparse* teacher signal, from the student's hidden states, a chunk at a time.

A sparse teacher (an offline top-k cache, a vLLM server; ``lightning_gkd.teachers.TopKSignal``) gives, at each
supervised position, its ``k`` most likely next-token ids ``K`` and their log-probs ``t_k`` (log-softmax at
temperature 1), not its full distribution. Two losses use it:

``topk_distillation_loss`` (``tail=True``) is the exact generalized JSD(β) between *coarse-grained* distributions
over the ``k + 1`` buckets ``K ∪ {rest}``: the teacher's ``p_k = exp(t_k)``, ``p_rest = 1 − Σ_k p_k``, and the
student's own probabilities of the same buckets, ``s_k = log_softmax(z)_k`` and ``s_rest = log Σ_{v∉K} softmax(z)_v``
(a log-sum-exp over the complement, never ``1 −`` a rounded sum). Both are true distributions, the image of the full
ones under the same map ``v ↦ bucket(v)``, so the value is a true divergence of them, zero iff the student matches
the teacher on every bucket, and it equals the dense loss when ``K`` is the whole vocabulary. By the data-processing
inequality (an f-divergence cannot grow under a coarser partition) it is non-decreasing in ``k`` for nested top-k
sets and bounded by the dense divergence. ``tail=False`` renormalises both over ``K`` alone (no rest bucket): the
cheaper approximation TRL-style top-k servers use; not monotone in ``k``, and blind to mass the student puts outside
``K``.

Masked entries: an id of ``MASKED_ID`` (−1) in the teacher's ids marks an entry that is not one of the student's
tokens (a served teacher whose vocabulary is padded past the student's returned a padded row there:
``teachers.server``). It is not a bucket: it contributes nothing to the loss or its gradient, and its log-prob is not
read. With the tail bucket its teacher mass stays in ``p_rest = 1 − Σ_{kept} p_k`` (the mass of every token outside
the kept ids, padded rows included, which a trained model gives ~0); renormalised (``tail=False``) it is dropped with
the rest of the tail. A row with every entry masked contributes 0 (renormalised) or compares ``p_rest = 1`` with the
student's whole mass (tail: 0). The value equals the loss of the same signal with the masked entries removed.

``sampled_kl_loss`` is for on-policy batches where only the teacher's log-prob of the student's sampled token is
known: the single-sample estimators k1 and k3 of the reverse KL.

As in ``lightning_gkd.ops.divergence.chunked_jsd``, only ``chunk_size`` positions are projected to logits at a time,
and the loss's gradient with respect to those logits, in closed form, is folded into the gradients of the hidden
states and the head's weight and bias during the forward pass: extra memory O(``chunk_size`` × V).

Gradient of a bucket loss ``f(σ)`` (σ_j the student's coarse log-probs) with respect to the student logits ``z``:
with ``h_j = ∂f/∂σ_j``, ``H = Σ_j h_j``, ``S = softmax(z)``,

``∂f/∂z_v = h_{j(v)} · S_v / q_{j(v)} − S_v · H``

(``S_v / q_j = 1`` for a top-k bucket, the softmax over the complement for the rest bucket), where ``h = −p`` for
β = 0, ``h = q ⊙ (σ − t)`` for β = 1 and ``h = (1 − β) q ⊙ (σ − m)`` otherwise (``q = exp(σ)``,
``m = log(β p + (1 − β) q)``; the mixture's own dependence on ``q`` cancels, and for β = 1 the ``+ q`` term of
``∂(q log q)/∂σ`` drops because ``Σ q = 1``).
"""

from __future__ import annotations

import math

import torch

from lightning_gkd.ops.divergence.chunked_head import check_hidden_and_head, check_token_ids, folded_head_loss
from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.hf.heads import LogitHead

__all__ = ["ESTIMATORS", "MASKED_ID", "sampled_kl_loss", "topk_distillation_loss"]

#: The single-sample estimators ``sampled_kl_loss`` knows.
ESTIMATORS = ("k1", "k3")

#: A teacher id that is no token of the student's (module docstring: masked entries).
MASKED_ID = -1

# Floor of the teacher's rest-bucket log-mass: the smallest normal float32. A rest mass that rounds to 0 or below
# (top-k probabilities summing to >= 1 in a float16 cache) is "0" for the forward KL, and costs the reverse KL a
# large but finite amount instead of infinity.
_LOG_TINY = math.log(torch.finfo(torch.float32).tiny)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x <= 0``, accurate at both ends (``expm1`` near 0, ``log1p`` far below)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _rest_log_mass(teacher: torch.Tensor) -> torch.Tensor:
    """``(C, 1)`` ``log(1 − Σ_k exp(t_k))``, the rest mass clamped to >= 0 (floored at ``_LOG_TINY``)."""
    total = torch.logsumexp(teacher, dim=-1, keepdim=True).clamp(max=0.0)
    return _log1mexp(total).clamp(min=_LOG_TINY)


def _xlogy_terms(prob: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """``prob · diff`` with ``0 · anything = 0`` (a bucket of zero probability contributes nothing)."""
    return torch.where(prob > 0, prob * diff, torch.zeros((), dtype=prob.dtype, device=prob.device))


def _bucket_loss(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed generalized JSD(β) between coarse log-distributions ``(C, J)`` and ``h = ∂loss/∂student``."""
    if beta == 0:
        p = teacher.exp()
        return _xlogy_terms(p, teacher - student).sum(), -p
    q = student.exp()
    if beta == 1:
        terms = _xlogy_terms(q, student - teacher)
        return terms.sum(), terms
    mixture = torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    student_part = _xlogy_terms(q, student - mixture).mul_(1 - beta)
    teacher_part = _xlogy_terms(teacher.exp(), teacher - mixture).mul_(beta)
    return (teacher_part.sum() + student_part.sum()), student_part


def _topk_chunk_loss(
    logits: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor, *, beta: float, tail: bool, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss of a chunk: student ``logits`` ``(C, V)`` (overwritten), teacher ``ids``/``teacher`` ``(C, k)``.
    Negative ids are masked entries (module docstring): both sides get log-prob −inf there, a bucket of zero mass
    on both sides, which adds 0 to the value and to ``h`` (``_xlogy_terms``), and is kept out of the rest bucket."""
    masked = ids < 0
    any_masked = bool(masked.any())
    index = ids.clamp(min=0)  # a masked entry reads (and adds 0 to) some column; its values are overwritten
    picked = logits.gather(1, index)
    if any_masked:
        picked = picked.masked_fill(masked, -math.inf)
        teacher = teacher.masked_fill(masked, -math.inf)
    if not tail:  # renormalised over K: the gradient lives on the K columns only
        empty = masked.all(dim=-1, keepdim=True)  # no kept entry: nothing to compare, the row adds 0
        student = (picked - torch.logsumexp(picked, dim=-1, keepdim=True)).masked_fill(empty, -math.inf)
        renormalised = (teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)).masked_fill(empty, -math.inf)
        loss, h = _bucket_loss(student, renormalised, beta)
        if not need_grad:
            return loss, None
        grad_k = h - student.exp() * h.sum(dim=-1, keepdim=True)
        return loss, logits.zero_().scatter_add_(1, index, grad_k)
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    student = picked - log_norm
    rest_logits = None
    if any_masked or ids.shape[1] < logits.shape[1]:  # K is not the whole vocabulary (ids are distinct): a rest bucket
        if any_masked:  # the kept columns to −inf, a masked entry's column untouched (amin with +inf)
            fill = torch.full_like(picked, -math.inf).masked_fill(masked, math.inf)
            rest_logits = logits.scatter_reduce(1, index, fill, reduce="amin")
        else:
            rest_logits = logits.scatter(1, ids, -math.inf)
        rest_norm = torch.logsumexp(rest_logits, dim=-1, keepdim=True)
        student = torch.cat([student, rest_norm - log_norm], dim=1)
        teacher = torch.cat([teacher, _rest_log_mass(teacher)], dim=1)
    loss, h = _bucket_loss(student, teacher, beta)
    if not need_grad:
        return loss, None
    grad = logits.sub_(log_norm).exp_().mul_(-h.sum(dim=-1, keepdim=True))  # −S·H, in the logits' storage
    if rest_logits is not None:
        grad.add_(rest_logits.sub_(rest_norm).exp_().mul_(h[:, -1:]))  # softmax over the complement · h_rest
        h = h[:, :-1]
    return loss, grad.scatter_add_(1, index, h)


def _sampled_chunk_loss(
    logits: torch.Tensor, tokens: torch.Tensor, teacher: torch.Tensor, *, estimator: str, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed k1/k3 of a chunk: student ``logits`` ``(C, V)`` (overwritten), ``tokens``/``teacher`` ``(C,)``."""
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    diff = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - log_norm.squeeze(1) - teacher  # s − t
    if estimator == "k1":
        loss, coef = diff.sum(), diff  # score function: sg(s − t) · ∇s
    else:
        ratio_minus_one = torch.expm1(-diff)  # r − 1, r = exp(t − s)
        loss, coef = (ratio_minus_one + diff).sum(), -ratio_minus_one  # pathwise: (1 − r) · ∇s
    if not need_grad:
        return loss, None
    coef = coef.unsqueeze(1)
    grad = logits.sub_(log_norm).exp_().mul_(-coef)  # ∇_z s = onehot(x) − S
    return loss, grad.scatter_add_(1, tokens.unsqueeze(1), coef)


def topk_distillation_loss(
    student_hidden: torch.Tensor,
    student_head: LogitHead | torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    beta: float = 0.0,
    tail: bool = True,
    chunk_size: int = 256,
    num_items_in_batch: int | torch.Tensor | None = None,
    figures: SampleFigures | None = None,
) -> torch.Tensor:
    r"""Mean generalized JSD(β) over positions between the teacher's top-k signal and the student.

    With ``tail=True`` (default), over the ``k + 1`` buckets ``K ∪ {rest}`` of each position (module docstring):
    teacher ``t = [t_1 … t_k, t_rest]``, ``t_rest = log(1 − Σ_k exp(t_k))`` (``log1p(−exp(logsumexp(t)))``,
    computed accurately near 0; a rest mass that rounds to <= 0, as top-k log-probs from a float16 cache can, is
    treated as 0, floored at the smallest normal float32 so that no value or gradient is infinite); student
    ``s = [log_softmax(z)_K, logsumexp(z_{∉K}) − logsumexp(z)]``. Per position, with ``P = exp(t)``, ``Q = exp(s)``
    and ``M = β P + (1 − β) Q``:

    * β = 0: ``KL(P‖Q) = Σ_j P_j (t_j − s_j)`` (forward KL)
    * β = 1: ``KL(Q‖P) = Σ_j Q_j (s_j − t_j)`` (reverse KL)
    * otherwise ``β KL(P‖M) + (1 − β) KL(Q‖M)``, as ``ops.divergence.jsd.generalized_jsd_loss`` defines it,

    with ``0 · log 0 = 0``. When ``K`` is the whole vocabulary there is no rest bucket and this equals
    ``generalized_jsd_loss(student_head.logits(student_hidden), teacher_logits, beta=beta)`` (batchmean over the
    ``N`` rows), in value and gradients.

    ``tail=False``: both distributions renormalised over ``K`` alone, ``t − logsumexp(t)`` and
    ``z_K − logsumexp(z_K)``, no rest bucket: the cheaper approximation TRL-style top-k servers use. It ignores
    (and gives no gradient to) the student's mass outside ``K``.

    Args:
        student_hidden: ``(N, H)`` student final hidden states at the supervised positions.
        student_head: the student's ``LogitHead`` (logits ``softcap(scale · (h @ Wᵀ + b))``) or a ``(V, H)`` weight.
        teacher_ids: ``(N, k)`` integer ids of the teacher's top-k tokens, distinct in each row, ``1 <= k <= V``;
            ``MASKED_ID`` (−1) marks a masked entry (module docstring: it contributes nothing, and its mass stays in
            the rest bucket), repeated as often as needed.
        teacher_logprobs: ``(N, k)`` the teacher's log-softmax (temperature 1) at those ids, any float dtype
            (upcast to float32); not read at masked entries.
        beta: in ``[0, 1]``; 0 forward KL(T‖S), 1 reverse KL(S‖T).
        tail: keep the rest bucket (exact coarse divergence) or renormalise over ``K``.
        chunk_size: positions projected to logits at a time.
        num_items_in_batch: divide the sum over positions by this instead of ``N``.
        figures: when given (on the student's own samples), each chunk's student logits are also added to it
            before the loss reuses their storage (``ops.sample_figures``; the teacher's side is its top-1).

    Returns:
        A 0-dim float32 tensor; its gradients with respect to ``student_hidden`` and the head's weight and bias
        are computed during the forward pass and scaled by the incoming gradient in the backward pass.
    """
    head = student_head if isinstance(student_head, LogitHead) else LogitHead(student_head)
    normalizer = check_hidden_and_head(student_hidden, head, chunk_size, num_items_in_batch)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}.")
    vocab, positions = head.weight.shape[0], student_hidden.shape[0]
    if teacher_ids.dim() != 2 or teacher_ids.shape[0] != positions or teacher_ids.shape != teacher_logprobs.shape:
        raise ValueError(
            f"teacher_ids {tuple(teacher_ids.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} must both "
            f"be (N, k) with N = {positions}, the number of student_hidden rows."
        )
    k = teacher_ids.shape[1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k (teacher_ids.shape[1]) must be in [1, {vocab}] (the student's vocabulary), got {k}.")
    if teacher_ids.dtype.is_floating_point or teacher_ids.dtype == torch.bool:
        raise ValueError(f"teacher_ids must hold integer token ids, got dtype {teacher_ids.dtype}.")
    check_token_ids("teacher_ids", teacher_ids[teacher_ids != MASKED_ID], vocab)
    ids = teacher_ids.to(device=student_hidden.device, dtype=torch.long)
    if positions and k > 1:
        ordered = ids.sort(dim=1).values
        repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != MASKED_ID)).any(dim=1)
        if bool(repeated.any()):
            row = int(repeated.nonzero()[0, 0])
            raise ValueError(f"teacher_ids repeats an id in row {row} ({ids[row].tolist()}); a top-k set is distinct.")
    teacher = teacher_logprobs.detach().to(device=student_hidden.device, dtype=torch.float32)

    def chunk_loss(logits: torch.Tensor, rows: slice, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if figures is not None:
            figures.add(rows, logits)
        return _topk_chunk_loss(logits, ids[rows], teacher[rows], beta=float(beta), tail=tail, need_grad=need_grad)

    return folded_head_loss(student_hidden, head, chunk_loss, chunk_size, normalizer)


def sampled_kl_loss(
    student_hidden: torch.Tensor,
    student_head: LogitHead | torch.Tensor,
    tokens: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    estimator: str = "k1",
    chunk_size: int = 256,
    num_items_in_batch: int | torch.Tensor | None = None,
    figures: SampleFigures | None = None,
) -> torch.Tensor:
    r"""Mean single-sample estimate of the reverse KL(S‖T) over positions, from the student's own samples.

    With ``x`` the student's sampled next token, ``s = log p_S(x)`` (the student's log-softmax at ``x``, a chunked
    log-sum-exp over the vocabulary) and ``t = log p_T(x)``:

    * ``"k1"``: value ``s − t``, unbiased for KL(S‖T) when ``x ~ S`` but high-variance (and negative on some
      samples). Its gradient is the score-function estimate ``sg(s − t) · ∇s`` (the loss behaves like
      ``sg(s − t) · s``), whose expectation over ``x ~ S`` is exactly ``∇ KL(S‖T)``; the plain gradient ``∇s`` of
      the value would have expectation 0.
    * ``"k3"``: value ``(r − 1) − log r`` with ``r = exp(t − s)``: non-negative, lower-variance, unbiased for the
      value. Its gradient is the pathwise ``(1 − r) · ∇s``, whose expectation over ``x ~ S`` is
      ``−Σ_x p_T(x) ∇ log p_S(x)``: the gradient of the *forward* KL's cross-entropy, not of the reverse KL.

    Args:
        student_hidden: ``(N, H)`` student final hidden states at the positions that predict ``tokens``.
        student_head: the student's ``LogitHead`` or its ``(V, H)`` weight.
        tokens: ``(N,)`` integer ids of the sampled next tokens.
        teacher_logprobs: ``(N,)`` the teacher's log-prob of each token (any float dtype, upcast to float32).
        estimator: ``"k1"`` or ``"k3"``.
        chunk_size: positions projected to logits at a time.
        num_items_in_batch: divide the sum over positions by this instead of ``N``.
        figures: as in ``topk_distillation_loss``.

    Returns:
        A 0-dim float32 tensor, gradients folded in during the forward pass as in ``topk_distillation_loss``.
    """
    head = student_head if isinstance(student_head, LogitHead) else LogitHead(student_head)
    normalizer = check_hidden_and_head(student_hidden, head, chunk_size, num_items_in_batch)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")
    positions = student_hidden.shape[0]
    if tokens.shape != (positions,) or teacher_logprobs.shape != (positions,):
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} must both be (N,) "
            f"with N = {positions}, the number of student_hidden rows."
        )
    check_token_ids("tokens", tokens, head.weight.shape[0])
    ids = tokens.to(device=student_hidden.device, dtype=torch.long)
    teacher = teacher_logprobs.detach().to(device=student_hidden.device, dtype=torch.float32)

    def chunk_loss(logits: torch.Tensor, rows: slice, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if figures is not None:
            figures.add(rows, logits)
        return _sampled_chunk_loss(logits, ids[rows], teacher[rows], estimator=estimator, need_grad=need_grad)

    return folded_head_loss(student_hidden, head, chunk_loss, chunk_size, normalizer)
