"""ops/opd.py: the OPD policy-gradient surrogate. With γ = 0 on fresh samples its gradient is the sampled
reverse-KL (k1) gradient; a student equal to its teacher gets zero reward and no update; the truncated importance
weights make the expected gradient on a stale policy's samples exactly ∇ KL(S‖T) (by enumerating the vocabulary);
discounted advantages and their gradient against a direct float64 computation."""

import pytest
import torch

from lightning_gkd.ops.hf import LogitHead
from lightning_gkd.ops.losses import generalized_jsd_loss
from lightning_gkd.ops.opd import discounted_returns, policy_gradient_distillation_loss
from lightning_gkd.ops.sparse_kd import sampled_kl_loss

N, H, V = 7, 5, 11


def leaves(seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    return hidden, weight, b


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def test_gamma_zero_on_fresh_samples_is_the_sampled_reverse_kl_gradient():
    hidden, weight, bias = leaves(0)
    head = LogitHead(weight, bias, scale=0.7, softcap=3.0)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    teacher = torch.log_softmax(torch.randn(N, V, generator=torch.Generator().manual_seed(2)), -1)
    teacher_at = teacher.gather(1, tokens[:, None]).squeeze(1)
    ours, stats = policy_gradient_distillation_loss(hidden, head, tokens, teacher_at, chunk_size=3)
    k1 = sampled_kl_loss(hidden, head, tokens, teacher_at, estimator="k1", chunk_size=4)
    assert ours.item() == pytest.approx(k1.item(), rel=1e-5)  # the value: mean(s − t)
    for a, b in zip(grads(ours, (hidden, weight, bias)), grads(k1, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert stats.mean_weight.item() == 1.0 and stats.truncated_fraction.item() == 0.0
    assert stats.mean_reward.item() == pytest.approx(-k1.item(), rel=1e-5)


def test_a_student_equal_to_its_teacher_gets_zero_reward_and_no_update():
    hidden, weight, bias = leaves(3)
    head = LogitHead(weight, bias)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        own = torch.log_softmax(head.logits(hidden), -1).gather(1, tokens[:, None]).squeeze(1)
    rows = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    loss, stats = policy_gradient_distillation_loss(hidden, head, tokens, own, rows=rows, gamma=0.9)
    # zero up to float32 rounding of the two log-softmax computations
    assert abs(loss.item()) < 1e-6 and abs(stats.mean_reward.item()) < 1e-6
    assert all(g.abs().max() < 1e-6 for g in grads(loss, (hidden, weight, bias)))


def test_importance_weights_make_a_stale_policys_samples_give_the_reverse_kl_gradient():
    """Samples from an older head q: Σ_x q(x) ∇L(x) with w = p/q equals ∇ KL(S‖T) exactly (no weight truncated),
    each position's whole vocabulary enumerated."""
    hidden, weight, bias = leaves(5)
    head = LogitHead(weight, bias)
    old = LogitHead(
        weight.detach() + 0.3 * torch.randn(V, H, generator=torch.Generator().manual_seed(6)), bias.detach()
    )
    teacher_logits = torch.randn(N, V, generator=torch.Generator().manual_seed(7))
    teacher = torch.log_softmax(teacher_logits, -1)
    with torch.no_grad():
        q = torch.log_softmax(old.logits(hidden), -1)
    expected_value = torch.zeros(())
    total = torch.zeros(())
    for i in range(N):
        for v in range(V):
            token = torch.tensor([v])
            loss, stats = policy_gradient_distillation_loss(
                hidden[i : i + 1], head, token, teacher[i, v : v + 1], sampler_logprobs=q[i, v : v + 1], max_weight=1e9
            )
            total = total + q[i, v].exp() * loss / N
            expected_value = expected_value + q[i, v].exp() * loss.detach() / N
    reverse_kl = generalized_jsd_loss(head.logits(hidden), teacher_logits, beta=1.0)
    assert expected_value.item() == pytest.approx(reverse_kl.item(), rel=1e-4)  # the weighted k1 is unbiased too
    for a, b in zip(grads(total, (hidden, weight, bias)), grads(reverse_kl, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # truncated weights bias it, and say so
    _, stats = policy_gradient_distillation_loss(
        hidden,
        head,
        torch.arange(N) % V,
        teacher[torch.arange(N), torch.arange(N) % V],
        sampler_logprobs=torch.full((N,), -20.0),
        max_weight=2.0,
    )
    assert stats.truncated_fraction.item() == 1.0 and stats.max_weight.item() == 2.0


def test_discounted_returns_and_their_gradient_against_a_direct_computation():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    rows = torch.tensor([0, 0, 0, 3, 3])
    assert discounted_returns(rewards, rows, 0.5).tolist() == [2.75, 3.5, 3.0, 6.5, 5.0]
    assert discounted_returns(rewards, rows, 0.0).tolist() == rewards.tolist()

    hidden, weight, bias = leaves(8)
    head = LogitHead(weight, bias)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(9))
    teacher_at = -torch.rand(N, generator=torch.Generator().manual_seed(10)) * 3
    sampler = -torch.rand(N, generator=torch.Generator().manual_seed(11)) * 3
    rows = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    loss, _ = policy_gradient_distillation_loss(
        hidden,
        head,
        tokens,
        teacher_at,
        rows=rows,
        sampler_logprobs=sampler,
        gamma=0.8,
        max_weight=1.5,
        chunk_size=2,
        num_items_in_batch=10,
    )
    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    s = torch.log_softmax(h @ w.T + b, -1).gather(1, tokens[:, None]).squeeze(1)
    advantage = discounted_returns((teacher_at.double() - s).detach(), rows, 0.8)
    weights = torch.exp(s.detach() - sampler.double()).clamp(max=1.5)
    reference = -(weights * advantage * s).sum() / 10
    assert loss.item() == pytest.approx((-(weights * advantage).sum() / 10).item(), rel=1e-5)
    for a, r in zip(grads(loss, (hidden, weight, bias)), grads(reference, (h, w, b)), strict=True):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma": 1.5}, "gamma must be in"),
        ({"gamma": 0.5}, "pass rows"),
        ({"max_weight": 0.0}, "max_weight must be > 0"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"sampler_logprobs": torch.zeros(3)}, r"sampler_logprobs must be \(N,\)"),
    ],
)
def test_arguments_are_checked(kwargs, match):
    hidden, weight, _ = leaves(0, bias=False)
    with pytest.raises(ValueError, match=match):
        policy_gradient_distillation_loss(hidden, weight, torch.zeros(N, dtype=torch.long), torch.zeros(N), **kwargs)
