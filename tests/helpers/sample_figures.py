"""The float64 reference of lightning_gkd.ops.divergence.sample_figures, for the tests that check the figures a loss
gathers."""

import torch

from lightning_gkd.ops.divergence.sample_figures import STUDENT_TOP_K


def reference_figures(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, tokens: torch.Tensor, k: int = STUDENT_TOP_K
) -> dict[str, float]:
    """The three figures in float64 over every position at once (``(N, V)`` logits, ``(N,)`` sampled tokens):
    ``agreement`` (the teacher's argmax is the token), ``mass`` (the teacher's probability of the student's top-k),
    ``entropy`` (the student's, nats), each the mean over the positions."""
    s = student_logits.double().log_softmax(-1)
    t = teacher_logits.double().log_softmax(-1)
    top = s.topk(k, dim=-1).indices
    return {
        "agreement": (t.argmax(-1) == tokens.to(t.device)).double().mean().item(),
        "mass": t.exp().gather(-1, top).sum(-1).mean().item(),
        "entropy": -(s.exp() * s).sum(-1).mean().item(),
    }
