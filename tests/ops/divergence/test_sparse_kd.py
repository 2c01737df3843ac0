"""Losses from a sparse teacher signal (lightning_gkd.ops.divergence.sparse_kd): at k = V the top-k loss is the dense
generalized JSD in value and gradients; below it, the exact divergence of the coarse distributions over
K ∪ {rest} (checked against a hand-built float64 computation); robust to float16 top-k log-probs that sum past 1;
non-decreasing in k on the shipped toy teacher; masked entries (ids past the student's vocabulary from a padded
served teacher) contribute nothing, against golden numbers computed by hand. The sampled-token estimators k1/k3,
averaged exactly over the student's distribution, give the reverse KL, and the gradients of the reverse KL (k1) and
of the cross-entropy (k3)."""

import math

import pytest
import torch
from helpers.sample_figures import reference_figures
from transformers import AutoModelForCausalLM

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss
from lightning_gkd.ops.divergence.sparse_kd import MASKED_ID, sampled_kl_loss, topk_distillation_loss
from lightning_gkd.ops.divergence.topk import topk_log_probs
from lightning_gkd.ops.hf.heads import LogitHead, final_hidden_states, output_head
from lightning_gkd.teachers import LocalTeacher, supervised_positions
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path, tiny_causal_lm

TOL = {"atol": 1e-5, "rtol": 1e-5}
N, H, V = 13, 6, 17


def make_student(kind: str, seed: int = 0):
    """Leaves ``(hidden, weight, bias or None)`` and a head over them: plain, or with bias, scale and soft-cap."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).requires_grad_()
    weight = torch.randn(V, H, generator=generator).mul_(1.5).requires_grad_()
    if kind == "plain":
        return (hidden, weight, None), LogitHead(weight)
    bias = torch.randn(V, generator=generator).requires_grad_()
    return (hidden, weight, bias), LogitHead(weight, bias, scale=0.8, softcap=4.0)


def float64_logits(leaves, head: LogitHead) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The head's logits recomputed in float64 from float64 leaf copies (the reference side)."""
    copies = tuple(leaf.detach().double().requires_grad_() for leaf in leaves if leaf is not None)
    hidden, weight, *bias = copies
    z = hidden @ weight.T + (bias[0] if bias else 0.0)
    z = z * head.scale
    if head.softcap is not None:
        z = head.softcap * torch.tanh(z / head.softcap)
    return z, copies


def teacher_log_probs(seed: int = 1, spread: float = 2.5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(N, V, generator=generator, dtype=torch.float64) * spread, dim=-1)


def grads_of(value: torch.Tensor, leaves) -> list[torch.Tensor]:
    present = [leaf for leaf in leaves if leaf is not None]
    return list(torch.autograd.grad(value * 3.0, present))  # the incoming gradient must scale


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **TOL)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("kind", ["plain", "bias_scale_softcap"])
@pytest.mark.parametrize("chunk_size", [5, 1000])
def test_full_vocabulary_equals_dense_jsd(beta, tail, kind, chunk_size):
    leaves, head = make_student(kind)
    teacher = teacher_log_probs()
    # the ids in a different order in every row: nothing may rely on them being sorted
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(row)) for row in range(N)])
    value = topk_distillation_loss(
        leaves[0], head, ids, teacher.gather(1, ids).float(), beta=beta, tail=tail, chunk_size=chunk_size
    )
    z, copies = float64_logits(leaves, head)
    expected = generalized_jsd_loss(z, teacher, beta=beta)
    assert value.dtype == torch.float32 and value.dim() == 0
    torch.testing.assert_close(value.double(), expected, **TOL)
    assert_same(grads_of(value, leaves), grads_of(expected, copies))


@pytest.mark.parametrize("tail", [True, False])
def test_num_items_in_batch_divides_the_sum(tail):
    leaves, head = make_student("bias_scale_softcap")
    teacher = teacher_log_probs()
    ids = teacher.argsort(dim=1, descending=True)[:, :4]
    args = (leaves[0], head, ids, teacher.gather(1, ids).float())
    mean = topk_distillation_loss(*args, tail=tail, chunk_size=4)
    total = topk_distillation_loss(*args, tail=tail, chunk_size=4, num_items_in_batch=torch.tensor(2))
    torch.testing.assert_close(total, mean * N / 2)
    assert_same(grads_of(total, leaves), [g.double() * N / 2 for g in grads_of(mean, leaves)])


def hand_built_coarse_loss(z: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor, beta: float, tail: bool):
    """The coarse distributions written out with explicit sums (float64), then the divergence bucket by bucket."""
    probs = torch.softmax(z, dim=-1)
    in_k = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, True)
    q = probs.gather(1, ids)
    p = teacher.gather(1, ids).exp()
    if tail:
        q = torch.cat([q, (probs * ~in_k).sum(dim=1, keepdim=True)], dim=1)
        p = torch.cat([p, 1 - p.sum(dim=1, keepdim=True)], dim=1)
    else:
        q, p = q / q.sum(dim=1, keepdim=True), p / p.sum(dim=1, keepdim=True)
    if beta == 0:
        return (p * (p / q).log()).sum(dim=1).mean()
    if beta == 1:
        return (q * (q / p).log()).sum(dim=1).mean()
    m = beta * p + (1 - beta) * q
    return (beta * (p * (p / m).log()).sum(dim=1) + (1 - beta) * (q * (q / m).log()).sum(dim=1)).mean()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("k", [1, 4, V - 1])
def test_below_full_vocabulary_is_the_coarse_divergence(beta, tail, k):
    leaves, head = make_student("bias_scale_softcap")
    teacher = teacher_log_probs()
    # any distinct K works (not only the teacher's top-k): a random subset per row
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(9 + r))[:k] for r in range(N)])
    value = topk_distillation_loss(
        leaves[0], head, ids, teacher.gather(1, ids).float(), beta=beta, tail=tail, chunk_size=4
    )
    z, copies = float64_logits(leaves, head)
    expected = hand_built_coarse_loss(z, teacher, ids, beta, tail)
    torch.testing.assert_close(value.double(), expected, **TOL)
    assert_same(grads_of(value, leaves), grads_of(expected, copies))


def test_float16_top_k_summing_past_one_treats_the_rest_as_empty():
    leaves, head = make_student("bias_scale_softcap")
    cached = torch.tensor([math.log(0.6), math.log(0.3), math.log(0.1001)]).half().repeat(N, 1)
    assert float(cached[0].float().exp().sum()) > 1  # the rest mass rounds below 0
    certain = torch.zeros(N, 1, dtype=torch.float16)  # k = 1 at probability 1: the rest rounds to exactly 0
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(r))[:3] for r in range(N)])
    for logprobs, row_ids in ((cached, ids), (certain, ids[:, :1])):
        for beta in (0.0, 0.5, 1.0):
            value = topk_distillation_loss(leaves[0], head, row_ids, logprobs, beta=beta, chunk_size=5)
            assert torch.isfinite(value)
            assert all(torch.isfinite(g).all() for g in grads_of(value, leaves))
        # forward KL with the rest mass 0: Σ_k p_k (t_k − s_k), the rest bucket contributes nothing
        forward = topk_distillation_loss(leaves[0], head, row_ids, logprobs, beta=0.0)
        z, copies = float64_logits(leaves, head)
        t = logprobs.double()
        expected = (t.exp() * (t - torch.log_softmax(z, dim=-1).gather(1, row_ids))).sum(dim=1).mean()
        torch.testing.assert_close(forward.double(), expected, **TOL)
        assert_same(grads_of(forward, leaves), grads_of(expected, copies))


def one_position_student() -> tuple[torch.Tensor, torch.Tensor]:
    """One position over a 4-token student vocabulary, logits ``z = [1, 0, 2, -1]`` (identity head)."""
    return torch.tensor([[1.0, 0.0, 2.0, -1.0]], requires_grad=True), torch.eye(4)


def golden_masked_loss(beta: float, tail: bool) -> float:
    """By hand: the teacher (over 6 padded rows) gives token 2 p=.5, padded token 5 p=.3, token 0 p=.1; the student
    has 4 tokens. Kept buckets {2}, {0}; with the tail the rest bucket holds the teacher's .4 (token 5's .3 included)
    against the student's S1 + S3; renormalised, the teacher is [5/6, 1/6] over {2, 0}."""
    z = [1.0, 0.0, 2.0, -1.0]
    norm = sum(math.exp(v) for v in z)
    s = [math.exp(v) / norm for v in z]
    if tail:
        p, q = [0.5, 0.1, 0.4], [s[2], s[0], s[1] + s[3]]
    else:
        p, q = [5 / 6, 1 / 6], [s[2] / (s[2] + s[0]), s[0] / (s[2] + s[0])]
    if beta == 0:
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    if beta == 1:
        return sum(qi * math.log(qi / pi) for pi, qi in zip(p, q, strict=True))
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q, strict=True)]
    return sum(
        beta * pi * math.log(pi / mi) + (1 - beta) * qi * math.log(qi / mi) for pi, qi, mi in zip(p, q, m, strict=True)
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_masked_entries_contribute_nothing_golden(beta, tail):
    """A padded teacher's entry (id past the student's vocabulary, ``MASKED_ID`` in the signal) is left out: the value
    is the hand computation, and value and gradients equal those of the signal with the entry removed."""
    log = math.log
    masked_ids = torch.tensor([[2, MASKED_ID, 0]])
    masked_logprobs = torch.tensor([[log(0.5), -math.inf, log(0.1)]])
    removed_ids, removed_logprobs = torch.tensor([[2, 0]]), torch.tensor([[log(0.5), log(0.1)]])
    hidden, weight = one_position_student()
    value = topk_distillation_loss(hidden, weight, masked_ids, masked_logprobs, beta=beta, tail=tail)
    (grad,) = torch.autograd.grad(value, hidden)
    assert float(value.detach()) == pytest.approx(golden_masked_loss(beta, tail), rel=1e-5, abs=1e-7)
    removed = topk_distillation_loss(hidden, weight, removed_ids, removed_logprobs, beta=beta, tail=tail)
    (removed_grad,) = torch.autograd.grad(removed, hidden)
    torch.testing.assert_close(value, removed, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, removed_grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_masked_entries_anywhere_equal_the_rows_without_them(beta, tail):
    """Masked entries at any place of a row, several in a row, a row of masked entries only (it adds 0), a masked
    entry whose clamped column (0) is a kept id: the batch's value and gradients are the mean of each row's loss
    computed without its masked entries."""
    leaves, head = make_student("bias_scale_softcap")
    teacher = teacher_log_probs()
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(40 + r))[:5] for r in range(N)])
    ids[0] = torch.tensor([0, 3, 5, 7, 9])
    masks = torch.zeros(N, 5, dtype=torch.bool)
    masks[0, 1] = masks[1, 0] = masks[2, 4] = True
    masks[3, 1:4] = True
    masks[4] = True  # every entry masked
    logprobs = teacher.gather(1, ids).float()
    value = topk_distillation_loss(
        leaves[0], head, ids.masked_fill(masks, MASKED_ID), logprobs.masked_fill(masks, -7.0), beta=beta, tail=tail
    )
    grads = grads_of(value, leaves)
    total = torch.zeros(())
    for row in range(N):
        keep = ~masks[row]
        if not keep.any():
            if tail:  # p_rest = 1 against the student's whole mass: 0
                total = total + 0.0 * leaves[0][row].sum()
            continue
        total = total + topk_distillation_loss(
            leaves[0][row : row + 1],
            head,
            ids[row : row + 1, keep],
            logprobs[row : row + 1, keep],
            beta=beta,
            tail=tail,
        )
    expected = total / N
    torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, grads_of(expected, leaves), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_grad_and_empty_batch():
    leaves, head = make_student("plain")
    ids = torch.zeros(N, 1, dtype=torch.long)
    with torch.no_grad():
        value = topk_distillation_loss(leaves[0], head, ids, torch.zeros(N, 1))
    assert not value.requires_grad and torch.isfinite(value)
    empty = topk_distillation_loss(leaves[0][:0], head, ids[:0], torch.zeros(0, 1))
    assert float(empty.detach()) == 0.0
    (grad,) = torch.autograd.grad(empty, leaves[1])
    assert not grad.any()


def test_errors_name_the_values():
    leaves, head = make_student("plain")
    hidden, ids, logprobs = leaves[0], torch.zeros(N, 2, dtype=torch.long), torch.zeros(N, 2)
    ids[:, 1] = 1
    cases = [
        (lambda: topk_distillation_loss(hidden[:3], head, ids, logprobs), r"N = 3"),
        (lambda: topk_distillation_loss(hidden, head, ids, logprobs[:, :1]), r"\(13, 1\)"),
        (lambda: topk_distillation_loss(hidden, head, ids, logprobs, beta=1.5), "beta must be in"),
        (lambda: topk_distillation_loss(hidden, head, ids, logprobs, chunk_size=0), "chunk_size must be >= 1, got 0"),
        (lambda: topk_distillation_loss(hidden, head, ids + V - 1, logprobs), rf"\[0, {V}\).*from {V - 1} to {V}"),
        (lambda: topk_distillation_loss(hidden, head, ids - 2, logprobs), r"from -2 to -2"),  # -1: masked
        (lambda: topk_distillation_loss(hidden, head, ids.float(), logprobs), "integer token ids"),
        (lambda: topk_distillation_loss(hidden, head, torch.zeros(N, 2, dtype=torch.long), logprobs), "row 0"),
        (
            lambda: topk_distillation_loss(
                hidden, head, torch.zeros(N, V + 1, dtype=torch.long), torch.zeros(N, V + 1)
            ),
            rf"\[1, {V}\].*got {V + 1}",
        ),
        (lambda: topk_distillation_loss(hidden[:, :2], head, ids, logprobs), rf"\({V}, {H}\).*H = 2"),
        (lambda: sampled_kl_loss(hidden, head, ids[:, 0], logprobs[:, 0], estimator="k2"), r"\('k1', 'k3'\), got 'k2'"),
        (lambda: sampled_kl_loss(hidden, head, ids[:4, 0], logprobs[:, 0]), r"tokens \(4,\).*N = 13"),
        (lambda: sampled_kl_loss(hidden, head, ids[:, 0] + V, logprobs[:, 0]), rf"from {V} to {V}"),
        (lambda: sampled_kl_loss(hidden, head, ids[:, 0], logprobs[:, 0], chunk_size=-2), "got -2"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# ------------------------------------------------------------------------------------------ sampled-token k1 / k3


def expected_over_vocabulary(leaves, head: LogitHead, teacher: torch.Tensor, estimator: str) -> torch.Tensor:
    """Σ_i Σ_x p_S(x | i) · estimator_i(x) / N: every token of the vocabulary as a "sample" of every position,
    weighted by the (detached) student probability, one call per (position, token)."""
    weights = torch.softmax(head.logits(leaves[0]).detach(), dim=-1)
    total = torch.zeros((), dtype=torch.float32)
    for row in range(N):
        for token in range(V):
            per_token = sampled_kl_loss(
                leaves[0][row : row + 1],
                head,
                torch.tensor([token]),
                teacher[row, token : token + 1].float(),
                estimator=estimator,
            )
            total = total + weights[row, token] * per_token
    return total / N


@pytest.mark.parametrize("kind", ["plain", "bias_scale_softcap"])
def test_k1_and_k3_in_expectation(kind):
    leaves, head = make_student(kind)
    teacher = teacher_log_probs(spread=1.0)
    z, copies = float64_logits(leaves, head)
    reverse_kl = generalized_jsd_loss(z, teacher, beta=1.0)
    z, ce_copies = float64_logits(leaves, head)
    cross_entropy = -(teacher.exp() * torch.log_softmax(z, dim=-1)).sum(dim=1).mean()
    k1 = expected_over_vocabulary(leaves, head, teacher, "k1")
    k3 = expected_over_vocabulary(leaves, head, teacher, "k3")
    torch.testing.assert_close(k1.double(), reverse_kl, **TOL)
    torch.testing.assert_close(k3.double(), reverse_kl, **TOL)
    assert_same(grads_of(k1, leaves), grads_of(reverse_kl, copies))  # score function: ∇ KL(S‖T)
    assert_same(grads_of(k3, leaves), grads_of(cross_entropy, ce_copies))  # pathwise: ∇ CE(T, S), forward KL's


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sampled_batch_equals_its_rows(estimator):
    """One chunked call over many rows is the mean of the rows' own values, and of their gradients."""
    leaves, head = make_student("bias_scale_softcap")
    teacher = teacher_log_probs()
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    picked = teacher.gather(1, tokens.unsqueeze(1)).squeeze(1).float()
    batch = sampled_kl_loss(leaves[0], head, tokens, picked, estimator=estimator, chunk_size=4, num_items_in_batch=5)
    z, copies = float64_logits(leaves, head)
    s = torch.log_softmax(z, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    d = s - picked.double()
    value = d.sum() / 5 if estimator == "k1" else (torch.expm1(-d) + d).sum() / 5
    surrogate = (d.detach() * s).sum() / 5 if estimator == "k1" else value
    torch.testing.assert_close(batch.double(), value, **TOL)
    assert_same(grads_of(batch, leaves), grads_of(surrogate, copies))
    if estimator == "k3":
        assert float(batch.detach()) >= 0


@pytest.mark.parametrize("loss", ["topk", "k1"])
def test_sample_figures_ride_along_without_changing_the_loss(loss):
    """With ``figures``, each chunk's student logits give the student's entropy and, from the teacher's top-1 id,
    the agreement (ops.sample_figures' float64 reference) before the loss overwrites them; loss and gradients are
    those without them."""
    from lightning_gkd.ops.divergence.sample_figures import SampleFigures

    leaves, head = make_student("bias_scale_softcap")
    teacher = teacher_log_probs()
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))
    tokens[::2] = teacher[::2].argmax(-1)
    top, ids = teacher.topk(3, dim=-1)  # the teacher's top-3, most likely first
    top = top.float()

    def run(figures):
        if loss == "topk":
            value = topk_distillation_loss(leaves[0], head, ids, top, beta=0.5, chunk_size=4, figures=figures)
        else:
            picked = teacher.gather(1, tokens.unsqueeze(1)).squeeze(1).float()
            value = sampled_kl_loss(leaves[0], head, tokens, picked, estimator="k1", chunk_size=4, figures=figures)
        return value.detach(), grads_of(value, leaves)

    figures = SampleFigures(tokens, teacher_top1=ids[:, 0])
    with_figures, without = run(figures), run(None)
    assert torch.equal(with_figures[0], without[0])
    for got, want in zip(with_figures[1], without[1], strict=True):
        assert torch.equal(got, want)
    z, _ = float64_logits(leaves, head)
    expected = reference_figures(z.detach(), teacher, tokens)
    got = {name: value.item() for name, (value, _) in figures.means().items()}
    assert set(got) == {"agreement", "entropy"}  # no teacher mass on the student's top-k from a top-k signal
    assert got["agreement"] == pytest.approx(expected["agreement"]) and got["agreement"] >= 7 / N
    assert got["entropy"] == pytest.approx(expected["entropy"], abs=1e-5)


# ---------------------------------------------------------------------------------------------- real models

# Measured on the shipped toy teacher vs student_init, 32 val rows (175 supervised positions), V = 259. Forward KL
# (β = 0), tail=True, by k: 1: 0.66606, 2: 0.67708, 5: 0.68082, 20: 0.68151, 50: 0.68153, 259: 0.68158 = dense
# 0.68158. The same k with tail=False: 0.0, 0.24404, 0.45818, 0.61082, 0.62612, 0.68158 (far below until k = V).
# Reverse KL (β = 1), tail=True: 2.5388, 2.6365, 2.7762, 2.9726, 3.0208, 3.2505 = dense 3.2505: the student's
# mass outside the teacher's top-50 still carries 0.23 nats.
TOY_KS = (1, 2, 5, 20, 50, 259)


def hidden_and_heads(student, teacher, batch):
    """Both models' final hidden states at the supervised positions and their heads, one forward each."""
    positions = supervised_positions(batch["labels"])
    with torch.no_grad():
        hidden = final_hidden_states(student, batch["input_ids"], batch["attention_mask"], positions)
        teacher_hidden, teacher_head = LocalTeacher(teacher).hidden_states(batch, positions)
    return hidden, output_head(student), teacher_hidden, teacher_head


def losses_by_k(models, ks, beta: float) -> tuple[list[float], float]:
    """The tail loss for each k (the teacher's top-k as ``LocalTeacher.topk`` computes it) and the dense loss."""
    hidden, head, teacher_hidden, teacher_head = models
    with torch.no_grad():
        dense = float(generalized_jsd_loss(head.logits(hidden), teacher_head.logits(teacher_hidden), beta=beta))
        losses = []
        for k in ks:
            ids, logprobs, _ = topk_log_probs(teacher_hidden, teacher_head, k)
            losses.append(float(topk_distillation_loss(hidden, head, ids, logprobs, beta=beta)))
    return losses, dense


@pytest.fixture(scope="module")
def toy_models():
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    load = AutoModelForCausalLM.from_pretrained
    teacher = load(asset_path("toy/teacher"), dtype=torch.float32).eval()
    student = load(asset_path("toy/student_init"), dtype=torch.float32).eval()
    batch = ChatMLCollator(tokenizer, max_length=64)(addition_rows(split="val")[:32])
    return tokenizer, batch, hidden_and_heads(student, teacher, batch), teacher


def test_local_teacher_signal_is_what_the_toy_tests_use(toy_models):
    tokenizer, batch, (_, _, teacher_hidden, teacher_head), teacher = toy_models
    signal = LocalTeacher(teacher, top_k=5).topk(batch, supervised_positions(batch["labels"]))
    ids, logprobs, _ = topk_log_probs(teacher_hidden, teacher_head, 5)
    assert signal.k == 5 and torch.equal(signal.ids, ids)
    torch.testing.assert_close(signal.logprobs, logprobs)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_toy_teacher_loss_grows_with_k_to_the_dense_loss(toy_models, beta):
    tokenizer, _, models, _ = toy_models
    assert len(tokenizer) == TOY_KS[-1] and models[0].shape[0] == 175
    losses, dense = losses_by_k(models, TOY_KS, beta)
    assert all(later >= earlier - 1e-6 for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] == pytest.approx(dense, rel=1e-5)
    recorded = {0.0: (0.66606, 0.68153, 0.68158), 1.0: (2.5388, 3.0208, 3.2505)}[beta]
    assert (losses[0], losses[-2], dense) == pytest.approx(recorded, abs=2e-4)


def test_llama_teacher_loss_grows_with_k_to_the_dense_loss(toy_models):
    tokenizer, batch, _, _ = toy_models
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    student = tiny_causal_lm(config, tokenizer, seed=0).eval()
    teacher = tiny_causal_lm(config, tokenizer, seed=1).eval()
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(40.0)  # a peaked teacher, so the top-k matter
    models = hidden_and_heads(student, teacher, batch)
    losses, dense = losses_by_k(models, (1, 3, 10, 60, len(tokenizer)), 0.0)
    assert all(later >= earlier - 1e-6 for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert losses[0] < 0.9 * dense  # the chain is not flat
    assert losses[-1] == pytest.approx(dense, rel=1e-5)
