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
import torch.nn.functional as F

from lightning_gkd.ops.chunked_head import folded_head_loss, head_logits
from lightning_gkd.ops.hf import LogitHead
from lightning_gkd.ops.sample_figures import SampleFigures

__all__ = ["projected_jsd_loss"]


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def _chunk_loss_and_logit_grad(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    beta: float,
    temperature: float,
    need_grad: bool,
    keep: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss over a chunk ``(C, V)`` and, if ``need_grad``, its gradient with respect to the student logits.
    ``keep(s, t, S or None)`` sees both log-softmaxes (and the student's softmax) before they are overwritten.

    Written with few fresh ``(C, V)`` tensors (intermediates are overwritten in place once used): at a 152k
    vocabulary each is ~40 MB, and a fresh allocation that large costs more in page faults than the arithmetic."""
    s = _log_probs(student_logits, temperature)
    t = _log_probs(teacher_logits, temperature)
    if beta == 0:
        if keep is not None:
            keep(s, t, None)
        T = t.exp()
        loss = (T * (t - s)).sum()
        if not need_grad:
            return loss, None
        grad = s.exp_().sub_(T)
        return loss, (grad if temperature == 1.0 else grad.div_(temperature))
    S = s.exp()
    if keep is not None:
        keep(s, t, S)
    if beta == 1:
        g = t.neg_().add_(s)  # s - t, in t's storage
        loss = torch.dot(S.flatten(), g.flatten())
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))  # log(β T + (1 − β) S)
        T = t.exp()
        teacher_part = torch.dot(T.flatten(), t.sub_(m).flatten())  # Σ T (t − m)
        g = m.neg_().add_(s).mul_(1 - beta)  # (1 − β)(s − m), in m's storage
        loss = beta * teacher_part + torch.dot(S.flatten(), g.flatten())
    if not need_grad:
        return loss, None
    row = torch.einsum("cv,cv->c", S, g).unsqueeze(-1)  # Σ_v S_v g_v per position
    grad = g.sub_(row).mul_(S)
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

    A head (``lightning_gkd.ops.hf.LogitHead``) is ``logits = softcap(scale · (h @ Wᵀ + b))``; the gradient passes
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

    def chunk_loss(student_logits: torch.Tensor, rows: slice, need_grad: bool):
        teacher_logits, _ = head_logits(teacher_hidden[rows], frozen_teacher)
        keep = None
        if figures is not None and temperature == 1.0:  # the loss's own log-softmaxes are the figures' (T = 1)
            keep = partial(figures.add_log_probs, rows)
        elif figures is not None:
            figures.add(rows, student_logits, teacher_logits)
        return _chunk_loss_and_logit_grad(
            student_logits,
            teacher_logits,
            beta=float(beta),
            temperature=float(temperature),
            need_grad=need_grad,
            keep=keep,
        )

    return folded_head_loss(student_hidden, student_head, chunk_loss, chunk_size, normalizer)
