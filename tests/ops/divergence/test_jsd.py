"""Tests for lightning_gkd.ops.divergence.jsd."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss

LN9_TIMES_0_8 = 0.8 * math.log(9.0)  # 1.7577796618689758


def _log_probs(*probs: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits equal to log-probabilities, shaped (1, 1, V)."""
    return torch.tensor(probs, dtype=dtype).log().view(1, 1, -1)


def _random_logits(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(*shape, generator=g)).to(dtype)


# --------------------------------------------------------------------------- known values


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_two_token_kl_known_value(beta: float) -> None:
    # KL([0.9, 0.1] || [0.1, 0.9]) = 0.9 ln 9 - 0.1 ln 9 = 0.8 ln 9, in both directions.
    student = _log_probs(0.1, 0.9)
    teacher = _log_probs(0.9, 0.1)
    loss = generalized_jsd_loss(student, teacher, beta=beta)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(LN9_TIMES_0_8, abs=1e-12)


def test_two_token_jsd_known_value() -> None:
    # JSD(0.5) with M = [0.5, 0.5]: 0.5 * 2 * KL([0.1, 0.9] || [0.5, 0.5]).
    student = _log_probs(0.1, 0.9)
    teacher = _log_probs(0.9, 0.1)
    expected = 0.1 * math.log(0.2) + 0.9 * math.log(1.8)
    loss = generalized_jsd_loss(student, teacher, beta=0.5)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_temperature_scales_logits() -> None:
    student = _random_logits(2, 3, 7, seed=0)
    teacher = _random_logits(2, 3, 7, seed=1)
    for beta in (0.0, 0.3, 1.0):
        scaled = generalized_jsd_loss(student, teacher, beta=beta, temperature=2.5)
        manual = generalized_jsd_loss(student / 2.5, teacher / 2.5, beta=beta)
        torch.testing.assert_close(scaled, manual, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_identical_and_uniform_inputs_give_zero(beta: float) -> None:
    logits = _random_logits(2, 4, 9, seed=2)
    assert generalized_jsd_loss(logits, logits.clone(), beta=beta).item() == pytest.approx(0.0, abs=1e-12)
    uniform = torch.zeros(2, 4, 9, dtype=torch.float64)
    # Constant shift of the logits does not change the softmax.
    assert generalized_jsd_loss(uniform, uniform + 5.0, beta=beta).item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_non_negative(beta: float) -> None:
    student = _random_logits(3, 5, 11, seed=3)
    teacher = _random_logits(3, 5, 11, seed=4)
    per_token = generalized_jsd_loss(student, teacher, beta=beta, reduction="none").sum(-1)
    assert per_token.shape == (3, 5)
    assert (per_token > 0).all()


def test_jsd_half_is_exactly_symmetric() -> None:
    s = _random_logits(3, 5, 11, seed=5)
    t = _random_logits(3, 5, 11, seed=6)
    for reduction in ("none", "sum", "batchmean"):
        a = generalized_jsd_loss(s, t, beta=0.5, reduction=reduction)
        b = generalized_jsd_loss(t, s, beta=0.5, reduction=reduction)
        assert torch.equal(a, b), (reduction, (a - b).abs().max().item())


def test_beta_swaps_roles_of_student_and_teacher() -> None:
    # JSD(beta)(S, T) == JSD(1 - beta)(T, S) and forward KL(S, T) == reverse KL(T, S).
    s = _random_logits(2, 3, 8, seed=7)
    t = _random_logits(2, 3, 8, seed=8)
    for beta in (0.0, 0.2, 0.7):
        a = generalized_jsd_loss(s, t, beta=beta, reduction="sum")
        b = generalized_jsd_loss(t, s, beta=1.0 - beta, reduction="sum")
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- reductions


def test_reductions_relationships_without_labels() -> None:
    B, T, V = 3, 5, 11
    s = _random_logits(B, T, V, seed=9)
    t = _random_logits(B, T, V, seed=10)
    kwargs = dict(beta=0.3)
    none = generalized_jsd_loss(s, t, reduction="none", **kwargs)
    total = generalized_jsd_loss(s, t, reduction="sum", **kwargs)
    assert none.shape == (B, T, V)
    torch.testing.assert_close(total, none.sum(), rtol=0, atol=1e-12)
    # batchmean divides by the batch size B, not B * T.
    batchmean = generalized_jsd_loss(s, t, reduction="batchmean", **kwargs)
    torch.testing.assert_close(batchmean, total / B, rtol=0, atol=1e-12)
    assert not torch.isclose(batchmean, total / (B * T))
    # mean averages over every element, vocabulary included.
    mean = generalized_jsd_loss(s, t, reduction="mean", **kwargs)
    torch.testing.assert_close(mean, total / (B * T * V), rtol=0, atol=1e-12)


def test_reductions_with_labels() -> None:
    B, T, V = 2, 4, 6
    s = _random_logits(B, T, V, seed=11)
    t = _random_logits(B, T, V, seed=12)
    labels = torch.tensor([[1, -100, 3, 4], [-100, -100, 0, 5]])
    mask = labels != -100
    full = generalized_jsd_loss(s, t, beta=0.4, reduction="none")
    masked = generalized_jsd_loss(s, t, labels=labels, beta=0.4, reduction="none")
    assert masked.shape == (int(mask.sum()), V)
    torch.testing.assert_close(masked, full[mask], rtol=0, atol=1e-12)
    total = full[mask].sum()
    total_loss = generalized_jsd_loss(s, t, labels=labels, beta=0.4, reduction="sum")
    torch.testing.assert_close(total_loss, total, rtol=0, atol=1e-12)
    torch.testing.assert_close(generalized_jsd_loss(s, t, labels=labels, beta=0.4), total / 5, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        generalized_jsd_loss(s, t, labels=labels, beta=0.4, reduction="mean"),
        total / (5 * V),
        rtol=0,
        atol=1e-12,
    )
    # Masked positions do not influence the result at all.
    s2 = s.clone()
    s2[~mask] = 1e3
    torch.testing.assert_close(generalized_jsd_loss(s2, t, labels=labels, beta=0.4), total / 5, rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_items", [7, torch.tensor(7), torch.tensor(7.0)])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_num_items_in_batch_overrides_reduction(num_items, reduction: str) -> None:
    s = _random_logits(2, 4, 6, seed=13)
    t = _random_logits(2, 4, 6, seed=14)
    labels = torch.tensor([[1, -100, 3, 4], [-100, -100, 0, 5]])
    total = generalized_jsd_loss(s, t, labels=labels, reduction="sum")
    loss = generalized_jsd_loss(s, t, labels=labels, reduction=reduction, num_items_in_batch=num_items)
    assert loss.shape == ()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, total / 7, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("num_items", [None, 4])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_masked_is_zero_with_gradient_path(reduction: str, num_items, beta: float) -> None:
    s = _random_logits(2, 3, 5, seed=15, dtype=torch.float32).requires_grad_()
    t = _random_logits(2, 3, 5, seed=16, dtype=torch.float32).requires_grad_()
    labels = torch.full((2, 3), -100)
    loss = generalized_jsd_loss(s, t, labels=labels, beta=beta, reduction=reduction, num_items_in_batch=num_items)
    assert loss.shape == ()
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    assert s.grad is not None and t.grad is not None
    assert torch.count_nonzero(s.grad) == 0
    assert torch.count_nonzero(t.grad) == 0


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_half_precision_inputs_computed_in_float32(low: torch.dtype, beta: float) -> None:
    s = _random_logits(2, 6, 50, seed=17, dtype=low).requires_grad_()
    t = _random_logits(2, 6, 50, seed=18, dtype=low)
    labels = torch.tensor([[0, 1, -100, 2, 3, 4], [5, -100, -100, 6, 7, 8]])
    loss = generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=0.7)
    assert loss.dtype == torch.float32
    reference = generalized_jsd_loss(s.detach().float(), t.float(), labels=labels, beta=beta, temperature=0.7)
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-6, atol=1e-7)
    loss.backward()
    assert s.grad is not None and s.grad.dtype == low and torch.isfinite(s.grad.float()).all()


def test_float32_and_float64_preserved() -> None:
    for dtype in (torch.float32, torch.float64):
        s = _random_logits(2, 3, 5, seed=19, dtype=dtype)
        t = _random_logits(2, 3, 5, seed=20, dtype=dtype)
        assert generalized_jsd_loss(s, t).dtype == dtype
        assert generalized_jsd_loss(s, t, reduction="none").dtype == dtype


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(beta=-0.1), "beta"),
        (dict(beta=1.5), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(reduction="avg"), "reduction"),
    ],
)
def test_invalid_arguments_raise(kwargs: dict, match: str) -> None:
    s = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match=match):
        generalized_jsd_loss(s, s, **kwargs)


def test_unknown_reduction_message_names_value_and_choices() -> None:
    s = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError) as excinfo:
        generalized_jsd_loss(s, s, reduction="avg")
    message = str(excinfo.value)
    assert "'avg'" in message
    for choice in ("batchmean", "sum", "mean", "none"):
        assert choice in message


def test_shape_mismatches_raise() -> None:
    s = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="same shape"):
        generalized_jsd_loss(s, torch.zeros(2, 3, 6))
    with pytest.raises(ValueError, match="labels"):
        generalized_jsd_loss(s, s, labels=torch.zeros(2, 4, dtype=torch.long))


# --------------------------------------------------------------------------- parity with TRL

_PARITY_SHAPE = (3, 5, 11)
_PARITY_LABELS = torch.tensor(
    [
        [-100, -100, 4, 7, 1],
        [2, 3, -100, 9, -100],
        [-100, -100, -100, -100, 5],
    ]
)
_PARITY_CASES = list(
    itertools.product(
        [0.0, 0.1, 0.5, 0.9, 1.0],  # beta
        [0.5, 1.0, 2.0],  # temperature
        ["batchmean", "sum", "mean", "none"],  # reduction
        [False, True],  # labels
        [None, 7],  # num_items_in_batch
    )
)


@pytest.fixture(scope="module")
def trl_jsd():
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning on import
        from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _value_and_grads(fn, s, t, **kwargs):
    s = s.clone().requires_grad_()
    t = t.clone().requires_grad_()
    out = fn(s, t, **kwargs)
    out.sum().backward()
    return out.detach(), s.grad, t.grad


@pytest.mark.parametrize(
    "beta, temperature, reduction, use_labels, num_items",
    _PARITY_CASES,
    ids=[f"b{b}-T{T}-{r}-{'lab' if lab else 'nolab'}-n{n}" for b, T, r, lab, n in _PARITY_CASES],
)
def test_parity_with_trl(trl_jsd, beta, temperature, reduction, use_labels, num_items) -> None:
    s = _random_logits(*_PARITY_SHAPE, seed=100)
    t = _random_logits(*_PARITY_SHAPE, seed=101)
    kwargs = dict(
        labels=_PARITY_LABELS if use_labels else None,
        beta=beta,
        temperature=temperature,
        reduction=reduction,
        num_items_in_batch=num_items,
    )
    ours, ours_ds, ours_dt = _value_and_grads(generalized_jsd_loss, s, t, **kwargs)
    ref, ref_ds, ref_dt = _value_and_grads(trl_jsd, s, t, **kwargs)

    assert ours.dtype == ref.dtype == torch.float64
    assert ours.shape == ref.shape
    pairs = (
        ("value", ours, ref),
        ("d/d student", ours_ds, ref_ds),
        ("d/d teacher", ours_dt, ref_dt),
    )
    for name, a, b in pairs:
        diff = (a - b).abs().max().item()
        assert diff <= 1e-9, f"{name}: max abs diff {diff:.3e}"
