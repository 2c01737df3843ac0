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

import torch
import torch.nn.functional as F

__all__ = ["projected_jsd_loss"]


def _chunk_loss_and_logit_grad(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float, temperature: float, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss over a chunk ``(C, V)`` and, if ``need_grad``, its gradient with respect to the student logits."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        T = t.exp()
        loss = (T * (t - s)).sum()
        return loss, ((s.exp() - T) / temperature if need_grad else None)
    S = s.exp()
    if beta == 1:
        g = s - t
        loss = (S * g).sum()
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        loss = beta * (t.exp() * (t - m)).sum() + (1 - beta) * (S * (s - m)).sum()
        g = (1 - beta) * (s - m)
    if not need_grad:
        return loss, None
    return loss, S * (g - (S * g).sum(dim=-1, keepdim=True)) / temperature


class _ProjectedJSD(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        beta: float,
        temperature: float,
        chunk_size: int,
        normalizer: float,
        grad_hidden: bool,
        grad_weight: bool,
    ) -> torch.Tensor:
        need_grad = grad_hidden or grad_weight
        total = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
        hidden_grad = torch.zeros_like(student_hidden, dtype=torch.float32) if grad_hidden else None
        weight_grad = torch.zeros_like(student_weight, dtype=torch.float32) if grad_weight else None
        for start in range(0, student_hidden.shape[0], chunk_size):
            hs = student_hidden[start : start + chunk_size]
            student_logits = hs @ student_weight.t()
            teacher_logits = teacher_hidden[start : start + chunk_size] @ teacher_weight.t()
            loss, logit_grad = _chunk_loss_and_logit_grad(
                student_logits, teacher_logits, beta=beta, temperature=temperature, need_grad=need_grad
            )
            total += loss
            if logit_grad is not None:
                logit_grad = logit_grad.to(student_weight.dtype)
                if hidden_grad is not None:
                    hidden_grad[start : start + chunk_size] = logit_grad @ student_weight
                if weight_grad is not None:
                    weight_grad.addmm_(logit_grad.t().float(), hs.float())
        ctx.save_for_backward(
            *(g / normalizer if g is not None else torch.empty(0) for g in (hidden_grad, weight_grad))
        )
        ctx.dtypes = (student_hidden.dtype, student_weight.dtype)
        ctx.has = (grad_hidden, grad_weight)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden_grad, weight_grad = ctx.saved_tensors
        has_hidden, has_weight = ctx.has
        grad_h = (hidden_grad * grad_output).to(ctx.dtypes[0]) if has_hidden else None
        grad_w = (weight_grad * grad_output).to(ctx.dtypes[1]) if has_weight else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def projected_jsd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 256,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Mean generalized JSD over positions, from final hidden states and output-projection weights.

    Equals ``generalized_jsd_loss(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, beta=beta,
    temperature=temperature)`` with ``labels`` keeping every one of the ``N`` rows (``reduction="batchmean"``,
    i.e. the sum over positions divided by ``N``), in value and in gradients with respect to ``student_hidden``
    and ``student_weight``, but with O(``chunk_size`` × V) extra memory. Softmaxes run in float32 whatever the
    input dtype; the teacher inputs get no gradient.

    Args:
        student_hidden: ``(N, H_s)`` student final hidden states at the supervised positions only.
        student_weight: ``(V, H_s)`` student output projection (``lm_head.weight``; no bias).
        teacher_hidden: ``(N, H_t)`` teacher final hidden states at the same positions.
        teacher_weight: ``(V, H_t)`` teacher output projection.
        beta: 0 = forward KL(T‖S), 1 = reverse KL(S‖T), in between the generalized JSD.
        temperature: both distributions are ``softmax(logits / temperature)``.
        chunk_size: positions projected to logits at a time.
        num_items_in_batch: divide the sum by this instead of ``N`` (e.g. the token count of a whole
            accumulated batch).

    Returns:
        A 0-dim float32 tensor. Its gradients are computed during the forward pass (when autograd needs them) and
        scaled by the incoming gradient in the backward pass.
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"student_hidden has {student_hidden.shape[0]} positions but teacher_hidden has "
            f"{teacher_hidden.shape[0]}; pass the same supervised positions of both models."
        )
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"Vocabulary sizes differ: student {student_weight.shape[0]}, teacher {teacher_weight.shape[0]}."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    if num_items_in_batch is None:
        normalizer = float(max(student_hidden.shape[0], 1))
    else:
        normalizer = float(num_items_in_batch)
    grad_enabled = torch.is_grad_enabled()
    return _ProjectedJSD.apply(
        student_hidden,
        student_weight,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        float(beta),
        float(temperature),
        int(chunk_size),
        normalizer,
        grad_enabled and student_hidden.requires_grad,
        grad_enabled and student_weight.requires_grad,
    )
