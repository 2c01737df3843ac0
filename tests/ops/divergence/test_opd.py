"""ops/divergence/opd.py: the OPD policy-gradient surrogate. With γ = 0 on fresh samples its gradient is the sampled
reverse-KL (k1) gradient; a student equal to its teacher gets zero reward and no update; the truncated importance
weights make the expected gradient on a stale policy's samples exactly ∇ KL(S‖T) (by enumerating the vocabulary);
discounted advantages and their gradient against a direct float64 computation. The stabilisers for γ > 0: the
length-normalised, row-baselined advantages against a float64 loop, length normalisation removing the raw return's
preference for short samples, PPO's clipped surrogate against autograd of its explicit −min(...) formula, and the
defaults reproducing the plain surrogate exactly."""

import math

import pytest
import torch

from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.ops.divergence.opd import discounted_returns, policy_gradient_distillation_loss, token_advantages
from lightning_gkd.ops.divergence.sparse_kd import sampled_kl_loss
from lightning_gkd.ops.hf.heads import LogitHead

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
        ({"baseline": "mean"}, r"baseline must be 'none' .* or 'row' .*got 'mean'"),
        ({"baseline": "row"}, r"baseline='row' .*pass rows"),
        ({"clip_ratio": 0.0}, r"clip_ratio .* must be in \(0, 1\).*got 0\.0"),
        ({"clip_ratio": 1.0}, r"clip_ratio .* must be in \(0, 1\).*got 1\.0"),
        ({"clip_ratio": "0.2"}, r"clip_ratio .* must be in \(0, 1\).*got '0\.2'"),
        ({"length_normalize": "yes"}, r"length_normalize must be true or false, got 'yes'"),
    ],
)
def test_arguments_are_checked(kwargs, match):
    hidden, weight, _ = leaves(0, bias=False)
    with pytest.raises(ValueError, match=match):
        policy_gradient_distillation_loss(hidden, weight, torch.zeros(N, dtype=torch.long), torch.zeros(N), **kwargs)


ROWS = torch.tensor([0] * 5 + [2] + [3] * 3 + [7] * 8)  # uneven lengths 5, 1, 3, 8; row ids with gaps


def loop_advantages(rewards: list[float], rows: list[int], gamma: float, normalize: bool, baseline: str) -> list[float]:
    """The advantages written out, row by row and token by token, in Python floats (double precision)."""
    out: list[float] = []
    for row in sorted(set(rows)):
        r = [value for value, owner in zip(rewards, rows, strict=True) if owner == row]
        a = []
        for t in range(len(r)):
            total = sum(gamma ** (j - t) * r[j] for j in range(t, len(r)))  # 0.0 ** 0 == 1.0
            terms = sum(gamma ** (j - t) for j in range(t, len(r)))
            a.append(total / terms if normalize else total)
        mean = sum(a) / len(a)
        out.extend(value - mean if baseline == "row" else value for value in a)
    return out


@pytest.mark.parametrize("baseline", ["none", "row"])
@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_token_advantages_against_a_loop_over_rows(gamma, length_normalize, baseline):
    rewards = -torch.rand(ROWS.numel(), generator=torch.Generator().manual_seed(12), dtype=torch.float64) * 3
    expected = torch.tensor(
        loop_advantages(rewards.tolist(), ROWS.tolist(), gamma, length_normalize, baseline), dtype=torch.float64
    )
    ours = token_advantages(rewards, ROWS, gamma, length_normalize=length_normalize, baseline=baseline)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    single = token_advantages(rewards.float(), ROWS, gamma, length_normalize=length_normalize, baseline=baseline)
    assert single.dtype == torch.float32  # the loss's dtype, to float32 rounding
    torch.testing.assert_close(single.double(), expected, rtol=1e-5, atol=1e-5)
    if baseline == "row":  # every row's advantages sum to 0
        sums = torch.zeros(8, dtype=torch.float64).index_add_(0, ROWS, ours)
        assert sums.abs().max() < 1e-12
    if gamma == 0.0 and baseline == "none":
        assert torch.equal(ours, rewards)  # γ = 0: each token's own reward, normalised or not


def test_length_normalisation_stops_gamma_one_from_preferring_short_samples():
    """Two rows with the same per-token reward, 2 and 8 tokens long: the raw γ = 1 return makes the long row's
    advantages 2.7 times as negative on average (the gradient pushes its tokens down harder: the short-answer
    collapse); normalised, both rows have the same mean advantage, the per-token reward."""
    rows = torch.tensor([0] * 2 + [1] * 8)
    rewards = torch.full((10,), -0.7, dtype=torch.float64)

    def row_means(advantages):
        return [advantages[rows == row].mean().item() for row in (0, 1)]

    short, long = row_means(token_advantages(rewards, rows, 1.0))
    assert short == pytest.approx(-0.7 * 1.5) and long == pytest.approx(-0.7 * 4.5)
    normalised = token_advantages(rewards, rows, 1.0, length_normalize=True)
    assert row_means(normalised) == pytest.approx([-0.7, -0.7]) and torch.allclose(normalised, rewards)
    # a constant reward offset is all the row baseline removes once normalised: no advantage, no push at all
    centred = token_advantages(rewards, rows, 1.0, length_normalize=True, baseline="row")
    assert centred.abs().max() < 1e-12
    # the discount's own length preference goes too: γ = 0.5 normalises by (1 − 0.5^{L−t}) / (1 − 0.5)
    discounted = token_advantages(rewards, rows, 0.5, length_normalize=True)
    assert torch.allclose(discounted, rewards)
    raw = token_advantages(rewards, rows, 0.5)
    assert raw[1].item() == pytest.approx(-0.7) and raw[2].item() == pytest.approx(-0.7 * (1 - 0.5**8) / 0.5)


def stale_setup(seed: int):
    """Leaves, tokens, teacher log-probs, rows and sampler log-probs that put the ratio on both sides of 1 ± 0.2."""
    hidden, weight, bias = leaves(seed)
    head = LogitHead(weight, bias)
    g = torch.Generator().manual_seed(seed + 100)
    tokens = torch.randint(0, V, (N,), generator=g)
    teacher_at = -torch.rand(N, generator=g) * 3
    with torch.no_grad():
        own = torch.log_softmax(head.logits(hidden), -1).gather(1, tokens[:, None]).squeeze(1)
    sampler = own + torch.tensor([0.5, -0.4, 0.05, -0.6, 0.3, -0.1, 0.7])  # ρ = exp(−shift)
    return hidden, weight, bias, head, tokens, teacher_at, torch.tensor([0, 0, 0, 0, 1, 1, 1]), sampler


@pytest.mark.parametrize("baseline", ["none", "row"])
def test_clipped_surrogate_and_its_gradient_against_autograd_of_the_explicit_min(baseline):
    eps, w_max, gamma = 0.2, 1.7, 0.5
    hidden, weight, bias, head, tokens, teacher_at, rows, sampler = stale_setup(13)
    loss, stats = policy_gradient_distillation_loss(
        hidden,
        head,
        tokens,
        teacher_at,
        rows=rows,
        sampler_logprobs=sampler,
        gamma=gamma,
        max_weight=w_max,
        length_normalize=True,
        baseline=baseline,
        clip_ratio=eps,
        chunk_size=3,
    )
    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    s = torch.log_softmax(h @ w.T + b, -1).gather(1, tokens[:, None]).squeeze(1)
    advantage = torch.tensor(
        loop_advantages((teacher_at.double() - s).tolist(), rows.tolist(), gamma, True, baseline), dtype=torch.float64
    )
    ratio = torch.exp(s - sampler.double())
    ratio = ratio * (ratio.clamp(max=w_max) / ratio).detach()  # truncated at w_max as a value, ∇ρ = ρ ∇s still
    surrogate = -torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage).sum() / N
    assert loss.item() == pytest.approx(surrogate.item(), rel=1e-5)
    ours = grads(loss, (hidden, weight, bias))
    for a, r in zip(ours, grads(surrogate, (h, w, b)), strict=True):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-6)
    r = ratio.detach()
    clipped = ((advantage > 0) & (r > 1 + eps)) | ((advantage < 0) & (r < 1 - eps))
    assert 0 < clipped.sum() < N and (r > 1 + eps).any() and (r < 1 - eps).any() and (r == w_max).any()
    assert stats.clipped_fraction.item() == pytest.approx(clipped.double().mean().item())
    assert stats.mean_advantage.item() == pytest.approx(advantage.mean().item(), abs=1e-6)
    assert stats.mean_abs_advantage.item() == pytest.approx(advantage.abs().mean().item(), rel=1e-5)
    # the clipped tokens are the ones whose gradient went: unclipped, every token would push
    options = dict(rows=rows, sampler_logprobs=sampler, gamma=gamma, max_weight=w_max, length_normalize=True)
    unclipped, _ = policy_gradient_distillation_loss(hidden, head, tokens, teacher_at, baseline=baseline, **options)
    assert not torch.allclose(grads(unclipped, (hidden,))[0], ours[0])


def test_defaults_are_the_plain_surrogate_bit_for_bit_and_clipping_leaves_fresh_samples_alone():
    hidden, weight, bias, head, tokens, teacher_at, rows, sampler = stale_setup(14)
    common = dict(rows=rows, sampler_logprobs=sampler, gamma=0.8, max_weight=1.5, chunk_size=2)
    default, stats = policy_gradient_distillation_loss(hidden, head, tokens, teacher_at, **common)
    assert stats.clipped_fraction is None
    # the pre-stabiliser formula: value mean(−w·A), A the discounted return (its gradient: the test above)
    with torch.no_grad():
        s = torch.log_softmax(head.logits(hidden), -1).gather(1, tokens[:, None]).squeeze(1)
    advantage = discounted_returns(teacher_at - s, rows, 0.8)
    w = torch.exp(s - sampler).clamp(max=1.5)
    assert default.item() == pytest.approx(((-w * advantage).sum() / N).item(), rel=1e-6)
    assert torch.equal(token_advantages(teacher_at - s, rows, 0.8), advantage)  # no option: the return itself
    explicit, _ = policy_gradient_distillation_loss(
        hidden, head, tokens, teacher_at, length_normalize=False, baseline="none", clip_ratio=None, **common
    )
    assert torch.equal(default, explicit)
    for a, b in zip(grads(default, (hidden, weight, bias)), grads(explicit, (hidden, weight, bias)), strict=True):
        assert torch.equal(a, b)
    # fresh samples (w = 1) are inside any clip range: the clipped loss is the plain one, bit for bit
    fresh = dict(common, sampler_logprobs=None)
    plain, _ = policy_gradient_distillation_loss(hidden, head, tokens, teacher_at, **fresh)
    clipped, clip_stats = policy_gradient_distillation_loss(hidden, head, tokens, teacher_at, clip_ratio=0.1, **fresh)
    assert clip_stats.clipped_fraction.item() == 0.0 and torch.equal(plain, clipped)
    for a, b in zip(grads(plain, (hidden, weight, bias)), grads(clipped, (hidden, weight, bias)), strict=True):
        assert torch.equal(a, b)
    assert not math.isclose(default.item(), plain.item())  # the sampler's log-probs did weight the first loss
