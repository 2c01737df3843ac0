"""lightning_gkd.losses.base: combining losses over disjoint rows (the routed teachers' token mean, their logs by
their own reductions), the one fallback policy for a model whose head the lean path cannot describe, and the sample
figures every loss reports on a batch of the student's own samples (against a float64 reference from full logits)."""

import warnings

import pytest
import torch
from helpers.sample_figures import reference_figures

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.losses import STUDENT_SAMPLES, LeanPath, Logged, LossOutput, combine
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.opd import DensePolicyGradient, TopKPolicyGradient
from lightning_gkd.losses.settings import DivergenceSettings, PolicyGradientSettings
from lightning_gkd.losses.sparse import SampledDistillation, TopKDistillation
from lightning_gkd.ops.hf.heads import LeanForwardUnsupported
from lightning_gkd.ops.hf.model_inputs import causal_lm_logits
from lightning_gkd.teachers import LocalTeacher, next_tokens, supervised_positions
from lightning_gkd.toy import addition_rows


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


# -- the sample figures each loss gathers on a batch of the student's own samples ----------------------------------
FIGURE_KEYS = {
    "agreement": "teacher_top1_agreement",
    "mass": "teacher_mass_on_student_top5",
    "entropy": "student_entropy",
}


def sampled_rows(tokenizer):
    """A collated batch flagged as the student's samples (the figures' math does not care who wrote the tokens)."""
    batch = ChatMLCollator(tokenizer, max_length=64)(addition_rows("train", 6))
    return {**batch, STUDENT_SAMPLES: True}


def expected_figures(student, teacher, batch):
    positions = supervised_positions(batch["labels"])
    with torch.no_grad():
        student_logits, teacher_logits = causal_lm_logits(student, batch), causal_lm_logits(teacher, batch)
    tokens = next_tokens(batch["input_ids"], positions)
    return reference_figures(student_logits[positions], teacher_logits[positions], tokens), int(positions.sum())


def figure_logs(out):
    return {
        name: (float(out.logs[key].value), out.logs[key].weight) for name, key in FIGURE_KEYS.items() if key in out.logs
    }


def assert_figures(out, expected, count, names=("agreement", "mass", "entropy")):
    got = figure_logs(out)
    assert set(got) == set(names)
    for name in names:
        assert got[name] == (pytest.approx(expected[name], abs=2e-5), float(count)), name


@pytest.mark.parametrize("lean", [True, False])
def test_the_dense_loss_reports_the_figures_of_the_students_samples(student, teacher, tokenizer, lean):
    batch = sampled_rows(tokenizer)
    loss = DenseDistillation(LocalTeacher(teacher), DivergenceSettings(loss_chunk_size=5), lean=LeanPath(lean))
    out = loss(student, batch)
    assert_figures(out, *expected_figures(student, teacher, batch))
    plain = loss(student, {**batch, STUDENT_SAMPLES: False})  # dataset completions, teacher samples: none
    assert plain.logs == {} and torch.equal(plain.loss, out.loss)


@pytest.mark.parametrize("kind", ["topk", "k1"])
def test_a_top_k_teacher_gives_agreement_and_entropy(student, teacher, tokenizer, kind):
    batch = sampled_rows(tokenizer)
    source = LocalTeacher(teacher, top_k=5)
    if kind == "topk":
        loss = TopKDistillation(source, DivergenceSettings(beta=0.5, loss_chunk_size=5))
    else:
        loss = SampledDistillation(source, DivergenceSettings(beta=1.0, sparse_loss="k3"))
    expected, count = expected_figures(student, teacher, batch)
    assert_figures(loss(student, batch), expected, count, names=("agreement", "entropy"))
    assert loss(student, {k: v for k, v in batch.items() if k != STUDENT_SAMPLES}).logs == {}


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
@pytest.mark.parametrize("dense", [True, False])
def test_opd_reports_them_beside_its_own_logs(student, teacher, tokenizer, kl_coef, dense):
    batch = sampled_rows(tokenizer)
    settings = (PolicyGradientSettings(kl_coef=kl_coef), DivergenceSettings(beta=1.0, loss_chunk_size=5))
    loss = (
        DensePolicyGradient(LocalTeacher(teacher), *settings)
        if dense
        else TopKPolicyGradient(LocalTeacher(teacher, top_k=5), *settings)
    )
    out = loss(student, batch)
    expected, count = expected_figures(student, teacher, batch)
    assert_figures(out, expected, count, names=("agreement", "mass", "entropy") if dense else ("agreement", "entropy"))
    plain = loss(student, {**batch, STUDENT_SAMPLES: False})  # the same loss and rewards without the figures
    assert torch.equal(out.loss, plain.loss)
    assert {k: float(v.value) for k, v in plain.logs.items()} == {
        k: float(v.value) for k, v in out.logs.items() if k.startswith("opd/")
    }
