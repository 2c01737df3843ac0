"""preference_loss (sigmoid / hinge / IPO / cDPO / robust / EXO) and sequence_logps: golden values, formulas, TRL 1.16
as the oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.trl_dpo import trl_dpo_loss

from lightning_gkd import preference_loss
from lightning_gkd.ops.divergence.preference import PREFERENCE_LOSS_TYPES, sequence_logps, unused_label_smoothing


def pair(*values: float) -> list[torch.Tensor]:
    return [torch.tensor([v], dtype=torch.float64) for v in values]


GOLDEN = pair(-1.0, -2.0, -1.5, -1.5)  # chosen, rejected, ref chosen, ref rejected: Δ = 0.5 - (-0.5) = 1


def test_golden_values():
    assert preference_loss(*GOLDEN, beta=0.1).item() == pytest.approx(0.6443966600735709, abs=1e-15)
    assert preference_loss(*GOLDEN, beta=0.1, loss_type="hinge").item() == pytest.approx(0.9, abs=1e-15)
    ipo = preference_loss(
        *GOLDEN, beta=0.1, loss_type="ipo", chosen_lengths=torch.tensor([2]), rejected_lengths=torch.tensor([4])
    )
    assert ipo.item() == pytest.approx(21.390625, abs=1e-12)  # (0.5/2 + 0.5/4 - 5)^2


def test_policy_equal_to_reference_gives_ln2():
    logps = torch.tensor([-3.0, -10.0, -0.5])
    other = torch.tensor([-7.0, -1.0, -2.5])
    loss = preference_loss(logps, other, logps.clone(), other.clone(), beta=0.3)
    assert loss.shape == (3,)
    assert torch.allclose(loss, torch.full((3,), math.log(2.0)), atol=1e-7)
    assert torch.allclose(preference_loss(logps, other, logps, other, loss_type="hinge"), torch.ones(3))


def test_beta_multiplies_the_whole_difference():
    # Δ = (π_c - ref_c) - (π_r - ref_r) = (-4 + 1) - (-2 + 6) = -7; a β applied to the chosen term only would differ.
    c, r, rc, rr = pair(-4.0, -2.0, -1.0, -6.0)
    beta = 0.25
    assert preference_loss(c, r, rc, rr, beta=beta).item() == pytest.approx(math.log1p(math.exp(7 * beta)))
    assert preference_loss(c, r, rc, rr, beta=beta, loss_type="hinge").item() == pytest.approx(1 + 7 * beta)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_cdpo_is_conservative_dpo(eps):
    z = 0.1  # β·Δ of GOLDEN
    expected = -(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z)))
    cdpo = preference_loss(*GOLDEN, beta=0.1, loss_type="cdpo", label_smoothing=eps).item()
    assert cdpo == pytest.approx(expected, abs=1e-14)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge"])
def test_sigmoid_and_hinge_ignore_label_smoothing_as_trl_1_16(loss_type):
    # TRL <= 0.24 (and this project before) gave conservative DPO here: 0.6443966600735709 + 0.1 * 0.1.
    plain = {"sigmoid": 0.6443966600735709, "hinge": 0.9}[loss_type]
    smoothed = preference_loss(*GOLDEN, beta=0.1, loss_type=loss_type, label_smoothing=0.1).item()
    assert smoothed == pytest.approx(plain, abs=1e-15)


def test_unused_label_smoothing_names_the_loss_that_reads_it():
    assert unused_label_smoothing("sigmoid", 0.0) is None
    assert all(unused_label_smoothing(loss, 0.1) is None for loss in ("cdpo", "robust", "exo_pair"))
    sigmoid = unused_label_smoothing("sigmoid", 0.1)
    assert sigmoid is not None and sigmoid.startswith(
        "label_smoothing=0.1 has no effect with loss_type='sigmoid': as in TRL 1.16, only cdpo, robust, exo_pair"
    )
    assert "set loss_type=cdpo (Hydra: method.loss_type=cdpo)" in sigmoid
    hinge = unused_label_smoothing("hinge", 0.2)
    assert hinge is not None and "loss_type='hinge'" in hinge and "cdpo (Hydra" not in hinge


def random_pairs(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = [-8 * torch.rand(5, generator=g, dtype=torch.float64) for _ in range(4)]
    return logps, torch.tensor([3, 1, 7, 2, 9]), torch.tensor([2, 5, 1, 4, 9])


# Every loss we share with TRL 1.16, with ε 0 and 0.1 (exo_pair refuses ε = 0, as TRL does).
SHARED = [(t, eps) for t in PREFERENCE_LOSS_TYPES if t != "cdpo" for eps in (0.0, 0.1) if (t, eps) != ("exo_pair", 0.0)]


@pytest.mark.parametrize("loss_type, eps", SHARED)
def test_parity_with_trl(loss_type, eps):
    logps, chosen_lengths, rejected_lengths = random_pairs(0)
    for beta in (0.1, 0.5):
        ours = preference_loss(
            *logps,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=eps,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
        )
        trl = trl_dpo_loss(
            *logps,
            loss_type=loss_type,
            beta=beta,
            label_smoothing=eps,
            chosen_lengths=chosen_lengths.tolist(),
            rejected_lengths=rejected_lengths.tolist(),
        )
        assert ours.mean().item() == pytest.approx(trl.item(), abs=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cdpo_parity_with_trl_aot_on_single_pairs(eps):
    # TRL 1.16 has no cDPO; its `aot` loss is the same formula on sorted log-ratios, i.e. cDPO for one pair.
    logps, lengths, _ = random_pairs(1)
    for i in range(len(lengths)):
        pair = [t[i : i + 1] for t in logps]
        ours = preference_loss(*pair, beta=0.1, loss_type="cdpo", label_smoothing=eps)
        trl = trl_dpo_loss(
            *pair, loss_type="aot", beta=0.1, label_smoothing=eps, chosen_lengths=[1], rejected_lengths=[1]
        )
        assert ours.item() == pytest.approx(trl.item(), abs=1e-6)


def test_per_pair_output_and_gradient_direction():
    chosen = torch.tensor([-5.0, -1.0], requires_grad=True)
    rejected = torch.tensor([-2.0, -8.0], requires_grad=True)
    refs = torch.tensor([-3.0, -3.0])
    losses = preference_loss(chosen, rejected, refs, refs, beta=0.5)
    assert losses.shape == (2,) and losses[0] > losses[1]  # the first pair prefers the wrong completion
    losses.sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # raise chosen, lower rejected


def test_hinge_is_flat_past_the_margin():
    chosen = torch.tensor([0.0], requires_grad=True)
    loss = preference_loss(chosen, torch.tensor([-30.0]), torch.zeros(1), torch.zeros(1), beta=0.1, loss_type="hinge")
    loss.sum().backward()
    assert loss.item() == 0.0 and chosen.grad.item() == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "kto"}, "loss_type must be one of"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
        ({"loss_type": "exo_pair"}, r"exo_pair' needs label_smoothing > 0.*1e-3"),
        ({"loss_type": "ipo"}, "pass chosen_lengths and rejected_lengths"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        preference_loss(*GOLDEN, **kwargs)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"must all have shape \(B,\)"):
        preference_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))


# --------------------------------------------------------------------------- sequence log-probs


def naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    mask = labels != -100
    per_token = F.log_softmax(logits.double(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(-1)


def random_batch(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(3, 7, 50, generator=g)).to(dtype)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = -100
    labels[1, :] = -100  # a row without completion tokens
    return logits, labels


def test_sequence_logps_matches_naive_log_softmax_gather():
    logits, labels = random_batch(0)
    logits.requires_grad_(True)
    out = sequence_logps(logits, labels)
    assert out.shape == (3,) and out.dtype == torch.float32 and out[1].item() == 0.0
    expected = naive_sequence_logps(logits, labels)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-6)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (expected_grad,) = torch.autograd.grad(naive_sequence_logps(logits, labels).sum(), logits)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_sequence_logps_upcasts_half_precision():
    logits, labels = random_batch(1, dtype=torch.bfloat16)
    out = sequence_logps(logits, labels)
    assert out.dtype == torch.float32
    # Same values as the fp32 computation on the (exactly representable) bf16 logits.
    torch.testing.assert_close(out, sequence_logps(logits.float(), labels), atol=1e-5, rtol=0)


def test_sequence_logps_matches_trl_selective_log_softmax():
    from trl.trainer.utils import selective_log_softmax

    logits, labels = random_batch(2)
    mask = labels != -100
    trl_logps = (selective_log_softmax(logits, labels.clamp(min=0)) * mask).sum(-1)
    torch.testing.assert_close(sequence_logps(logits, labels), trl_logps, atol=1e-5, rtol=1e-6)


def test_sequence_logps_rejects_misaligned_shapes():
    with pytest.raises(ValueError, match=r"Expected logits \(B, T, V\) and labels \(B, T\)"):
        sequence_logps(torch.zeros(2, 5, 9), torch.zeros(2, 4, dtype=torch.long))
