"""The generalized JSD computed from hidden states, a chunk of positions at a time, never holding full logits.

``generalized_jsd_loss`` takes logits: for a batch of B rows, T positions and a vocabulary of V, each model's
logits are B × T × V floats, and autograd keeps several such tensors (log-softmaxes, the mixture) until the
backward pass. Here only the N supervised positions are projected to logits, ``C`` positions at a time, and the
gradient with respect to the student's logits is written down in closed form and folded into the gradients of the
hidden states and of the output-projection weight during the forward pass, so no logits outlive their chunk.
Extra memory is O(C × V) instead of O(B × T × V).

Gradient of the per-position loss with respect to the student logits ``z`` (with ``s = log_softmax(z / τ)``,
``S = exp(s)``, ``t``/``T`` the teacher's, ``m = log(β T + (1 − β) S)``):

* β = 0 (forward KL):  ``(S − T) / τ``
* otherwise:           ``S ⊙ (g − Σ_v S_v g_v) / τ`` with ``g = s − t`` for β = 1 and ``g = (1 − β)(s − m)`` for
  0 < β < 1 (the mixture's own dependence on S cancels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from lightning_gkd.ops.divergence.chunked_head import folded_head_loss, head_finish, head_projection
from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.hf.heads import LogitHead

__all__ = ["projected_jsd_loss"]

#: The elementwise work of a chunk runs on blocks of at most about this many logits (whole rows of ``V``, at least
#: one; a chunk's rows split evenly), each in the same three float32 scratch blocks (four for a non-float32 teacher),
#: reused across blocks and chunks.
#: Smaller blocks stay in a core's caches but each op then does too little work to split across threads; 2**23
#: (32 MB a block, 55 rows at V = 151936) was the faster side on a shared, loaded 2-core CPU (exp/log-softmax on 6 to
#: 256 rows of 151936: small blocks won with one thread, lost 5x with two busy ones).
ROW_BLOCK_ELEMENTS = 1 << 23


def _row_blocks(count: int, vocab: int) -> list[slice]:
    """Consecutive row slices of about equal size covering ``count`` rows, each at most
    ``ROW_BLOCK_ELEMENTS // vocab`` rows (at least 1)."""
    most = max(1, ROW_BLOCK_ELEMENTS // max(vocab, 1))
    blocks = -(-count // most)
    step = -(-count // max(blocks, 1))
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


def _chunk_loss_and_logit_grad(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    beta: float,
    temperature: float,
    need_grad: bool,
    keep: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss over a block ``(C, V)`` and, if ``need_grad``, its gradient with respect to the student logits,
    written over ``student_logits`` (float32, contiguous, the caller's to overwrite, as is ``teacher_logits``).
    ``scratch``: three float32 ``(C, V)`` blocks for the log-softmaxes and the mixture. ``keep(s, t, S or None)``
    sees both log-softmaxes (and the student's softmax) before they are overwritten.

    No fresh ``(C, V)`` tensor is made: at a 152k vocabulary a fresh block costs more in page faults than the
    arithmetic on it, so every intermediate goes to a scratch block or over an input that is no longer needed."""
    s, t, c = scratch
    z = student_logits
    if temperature != 1.0:
        z.div_(temperature)
        teacher_logits = teacher_logits.div_(temperature)
    torch.log_softmax(z, dim=-1, out=s)
    torch.log_softmax(teacher_logits, dim=-1, out=t)
    if beta == 0:
        if keep is not None:
            keep(s, t, None)
        T = torch.exp(t, out=c)
        loss = torch.dot(T.flatten(), t.sub_(s).flatten())  # Σ T (t − s)
        if not need_grad:
            return loss, None
        grad = torch.exp(s, out=z).sub_(T)
        return loss, (grad if temperature == 1.0 else grad.div_(temperature))
    S = torch.exp(s, out=c)
    if keep is not None:
        keep(s, t, S)
    if beta == 1:
        g = t.neg_().add_(s)  # s - t, in t's storage
        loss = torch.dot(S.flatten(), g.flatten())
    else:
        # log(β T + (1 − β) S), in the teacher logits' storage (read already)
        shifted_s, shifted_t = torch.add(s, math.log1p(-beta), out=z), torch.add(t, math.log(beta), out=teacher_logits)
        m = torch.logaddexp(shifted_s, shifted_t, out=teacher_logits)
        T = torch.exp(t, out=z)
        teacher_part = torch.dot(T.flatten(), t.sub_(m).flatten())  # Σ T (t − m)
        g = m.neg_().add_(s).mul_(1 - beta)  # (1 − β)(s − m), in m's storage
        loss = beta * teacher_part + torch.dot(S.flatten(), g.flatten())
    if not need_grad:
        return loss, None
    row = torch.einsum("cv,cv->c", S, g).unsqueeze(-1)  # Σ_v S_v g_v per position
    grad = torch.sub(g, row, out=z).mul_(S)
    return loss, (grad if temperature == 1.0 else grad.div_(temperature))


def projected_jsd_loss(
    student_hidden: torch.Tensor,
    student_head: LogitHead | torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: LogitHead | torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 256,
    num_items_in_batch: int | torch.Tensor | None = None,
    figures: SampleFigures | None = None,
) -> torch.Tensor:
    r"""Mean generalized JSD over positions, from final hidden states and each model's head.

    Equals ``generalized_jsd_loss(student_head.logits(student_hidden), teacher_head.logits(teacher_hidden),
    beta=beta, temperature=temperature)`` with ``labels`` keeping every one of the ``N`` rows
    (``reduction="batchmean"``, i.e. the sum over positions divided by ``N``), in value and in gradients with
    respect to ``student_hidden`` and the student head's weight and bias, but with O(``chunk_size`` × V) extra
    memory. Softmaxes run in float32 whatever the input dtype; the teacher inputs get no gradient.

    A head (``lightning_gkd.ops.hf.heads.LogitHead``) is ``logits = softcap(scale · (h @ Wᵀ + b))``; the gradient passes
    through it in closed form: ``d softcap(z)/dz = 1 − tanh²(z / cap)``, times ``scale``.

    Args:
        student_hidden: ``(N, H_s)`` student final hidden states at the supervised positions only.
        student_head: the student's ``LogitHead`` (or just its ``(V, H_s)`` output-projection weight).
        teacher_hidden: ``(N, H_t)`` teacher final hidden states at the same positions.
        teacher_head: the teacher's ``LogitHead`` (or its ``(V, H_t)`` weight).
        beta: 0 = forward KL(T‖S), 1 = reverse KL(S‖T), in between the generalized JSD.
        temperature: both distributions are ``softmax(logits / temperature)``.
        chunk_size: positions projected to logits at a time.
        num_items_in_batch: divide the sum by this instead of ``N`` (e.g. the token count of a whole
            accumulated batch).
        figures: when given (on the student's own samples), each chunk's two logits are also added to it
            (``ops.sample_figures``: teacher top-1 agreement, teacher mass on the student's top-k, student entropy).

    Returns:
        A 0-dim float32 tensor. Its gradients are computed during the forward pass (when autograd needs them) and
        scaled by the incoming gradient in the backward pass.
    """
    student_head = student_head if isinstance(student_head, LogitHead) else LogitHead(student_head)
    teacher_head = teacher_head if isinstance(teacher_head, LogitHead) else LogitHead(teacher_head)
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"student_hidden has {student_hidden.shape[0]} positions but teacher_hidden has "
            f"{teacher_hidden.shape[0]}; pass the same supervised positions of both models."
        )
    if student_head.weight.shape[0] != teacher_head.weight.shape[0]:
        raise ValueError(
            f"Vocabulary sizes differ: student {student_head.weight.shape[0]}, teacher {teacher_head.weight.shape[0]}."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if num_items_in_batch is None:
        normalizer = float(max(student_hidden.shape[0], 1))
    else:
        normalizer = float(num_items_in_batch)
    teacher_hidden = teacher_hidden.detach()
    frozen_teacher = LogitHead(
        teacher_head.weight.detach(),
        None if teacher_head.bias is None else teacher_head.bias.detach(),
        teacher_head.scale,
        teacher_head.softcap,
    )

    buffers: dict[str, torch.Tensor] = {}  # reused by every chunk: the teacher's projection, the scratch blocks

    def buffer(name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        if name not in buffers:
            buffers[name] = teacher_hidden.new_empty((rows, vocab), dtype=dtype)
        return buffers[name]

    vocab = student_head.weight.shape[0]
    chunk_rows = min(chunk_size, student_hidden.shape[0])

    def chunk_loss(student_logits: torch.Tensor, rows: slice, need_grad: bool):
        # the teacher's (C, V) product at once (one read of its weight per chunk); the softmaxes, loss and gradient
        # then a block of rows at a time, the gradient written over the student's logits (the driver's buffer)
        hidden, count = teacher_hidden[rows], student_logits.shape[0]
        projected = head_projection(hidden, frozen_teacher, out=buffer("teacher", chunk_rows, hidden.dtype)[:count])
        blocks = _row_blocks(count, vocab)
        block_rows = blocks[0].stop - blocks[0].start
        scratch = [buffer(f"scratch{i}", block_rows, torch.float32) for i in range(3)]
        total = student_logits.new_zeros(())
        for block in blocks:
            size = block.stop - block.start
            rows_here = slice(rows.start + block.start, rows.start + block.stop)
            student_block = student_logits[block]
            teacher_block = projected[block]
            if teacher_block.dtype != torch.float32:  # to float32 in a scratch block: the caller's buffer is ours
                teacher_block = buffer("teacher float32", block_rows, torch.float32)[:size].copy_(teacher_block)
            teacher_logits, _ = head_finish(teacher_block, frozen_teacher, in_place=True)
            keep = None
            if figures is not None and temperature == 1.0:  # the loss's own log-softmaxes are the figures' (T = 1)
                keep = partial(figures.add_log_probs, rows_here)
            elif figures is not None:
                figures.add(rows_here, student_block, teacher_logits)
            loss, _ = _chunk_loss_and_logit_grad(
                student_block,
                teacher_logits,
                (scratch[0][:size], scratch[1][:size], scratch[2][:size]),
                beta=float(beta),
                temperature=float(temperature),
                need_grad=need_grad,
                keep=keep,
            )
            total += loss
        return total, (student_logits if need_grad else None)

    return folded_head_loss(student_hidden, student_head, chunk_loss, chunk_size, normalizer)
