"""lightning_gkd.losses.base: combining losses over disjoint rows (the routed teachers' token mean, their logs by
their own reductions), and the one fallback policy for a model whose head the lean path cannot describe."""

import warnings

import pytest
import torch

from lightning_gkd.losses import LeanPath, Logged, LossOutput, combine
from lightning_gkd.ops.hf import LeanForwardUnsupported


def test_combine_is_the_count_weighted_mean_and_merges_logs_by_their_reductions():
    a = LossOutput(
        torch.tensor(1.0),
        torch.tensor(3),
        {"reward": Logged(torch.tensor(-1.0), 3.0), "max": Logged(torch.tensor(2.0), 3.0, "max")},
        {"student": torch.tensor(True)},
    )
    b = LossOutput(
        torch.tensor(4.0),
        torch.tensor(1),
        {
            "reward": Logged(torch.tensor(-5.0), 1.0),
            "max": Logged(torch.tensor(1.5), 1.0, "max"),
            "n": Logged(2, 1.0, "sum"),
        },
        {"student": torch.tensor(False), "teacher": torch.tensor(True)},
    )
    out = combine([a, b])
    assert out.loss.item() == pytest.approx((1.0 * 3 + 4.0 * 1) / 4) and int(out.count) == 4
    assert out.logs["reward"].value.item() == pytest.approx((-1.0 * 3 - 5.0) / 4) and out.logs["reward"].weight == 4
    assert out.logs["max"].value.item() == 2.0 and out.logs["max"].reduce == "max"
    assert out.logs["n"].value.item() == 2.0 and out.logs["n"].reduce == "sum"  # only the part that has it
    assert not bool(out.finite["student"]) and bool(out.finite["teacher"])  # and-ed per role
    with pytest.raises(ValueError, match="no parts"):
        combine([])


def test_combine_keeps_the_gradient_of_each_part():
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    out = combine([LossOutput(x[0] ** 2, torch.tensor(1)), LossOutput(x[1] ** 2, torch.tensor(3))])
    out.loss.backward()
    assert x.grad.tolist() == pytest.approx([2 * 2.0 / 4, 3 * 2 * 3.0 / 4])


def unsupported() -> float:
    raise LeanForwardUnsupported("Odd has no get_decoder()")


def test_a_loss_with_a_full_logits_form_warns_once_and_switches_to_it():
    lean = LeanPath()
    with pytest.warns(UserWarning, match=r"lean_loss: Odd has no get_decoder\(\); computing the dense loss from full"):
        assert lean.run(unsupported, lambda: 1.0, loss_name="dense") == 1.0
    assert lean.enabled is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the full path is taken directly now
        assert lean.run(unsupported, lambda: 2.0, loss_name="dense") == 2.0
    assert LeanPath(enabled=False).run(lambda: 0.0, lambda: 3.0, loss_name="dense") == 3.0


def test_a_loss_without_a_full_logits_form_raises_naming_the_model():
    lean = LeanPath(enabled=False)  # lean_loss=False does not apply to such a loss
    assert lean.run(lambda: 5.0, None, loss_name="top-k") == 5.0
    with pytest.raises(
        ValueError, match=r"The top-k loss reads .* and Odd has no get_decoder\(\); it has no full-logits"
    ):
        lean.run(unsupported, None, loss_name="top-k")
