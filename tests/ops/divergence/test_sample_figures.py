"""lightning_gkd.ops.divergence.sample_figures: the teacher's top-1 agreement with the sampled tokens, its mass on the
student's top-k and the student's entropy, against golden numbers and a float64 reference, chunk by chunk."""

import math

import pytest
import torch
from helpers.sample_figures import reference_figures as reference

from lightning_gkd.ops.divergence.sample_figures import SampleFigures
from lightning_gkd.ops.divergence.topk import topk_log_probs
from lightning_gkd.ops.hf.heads import LogitHead


def means(figures):
    return {name: (value.item(), count) for name, (value, count) in figures.means().items()}


def test_golden_numbers_on_two_positions():
    student = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]]).log()
    teacher = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]]).log()
    figures = SampleFigures(torch.tensor([1, 2]), k=2)
    figures.add(slice(0, 2), student, teacher)
    got = means(figures)
    # position 0: the teacher's top-1 (1) is the sample (1), it puts 0.1 + 0.6 on the student's top-2 {0, 1};
    # position 1: its top-1 (0) is not the sample (2), 0.1 + 0.1 on {3, 2}
    assert got["agreement"] == (pytest.approx(0.5), 2)
    assert got["mass"] == (pytest.approx((0.7 + 0.2) / 2), 2)
    entropies = [
        -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.1)),
        -sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4)),
    ]
    assert got["entropy"] == (pytest.approx(sum(entropies) / 2, abs=1e-6), 2)
    assert got["entropy"][0] == pytest.approx(1.2240683, abs=1e-6)


def test_chunk_by_chunk_equals_the_float64_reference():
    torch.manual_seed(0)
    n, vocab = 37, 50
    student, teacher = 3 * torch.randn(n, vocab), 3 * torch.randn(n, vocab)
    tokens = torch.randint(vocab, (n,))
    tokens[::3] = teacher[::3].argmax(-1)  # some agreement to count
    figures = SampleFigures(tokens)
    for start in range(0, n, 8):
        rows = slice(start, start + 8)
        figures.add(rows, student[rows], teacher[rows])
    expected = reference(student, teacher, tokens)
    got = means(figures)
    assert got["agreement"] == (pytest.approx(expected["agreement"], abs=1e-7), n)
    assert got["mass"] == (pytest.approx(expected["mass"], abs=1e-6), n)
    assert got["entropy"] == (pytest.approx(expected["entropy"], abs=1e-5), n)
    assert expected["agreement"] >= 13 / 37


def test_a_top_k_teacher_gives_agreement_and_entropy_but_no_mass():
    torch.manual_seed(1)
    student, teacher = torch.randn(10, 20), torch.randn(10, 20)
    tokens = torch.randint(20, (10,))
    figures = SampleFigures(tokens, teacher_top1=teacher.argmax(-1))
    figures.add(slice(0, 6), student[:6])
    figures.add(slice(6, 10), student[6:])
    expected = reference(student, teacher, tokens)
    got = means(figures)
    assert set(got) == {"agreement", "entropy"}
    assert got["agreement"][0] == pytest.approx(expected["agreement"])
    assert got["entropy"][0] == pytest.approx(expected["entropy"], abs=1e-5)
    alone = SampleFigures(tokens)  # neither teacher logits nor its top-1: the entropy only
    alone.add(slice(0, 10), student)
    assert set(means(alone)) == {"entropy"}


def test_hidden_states_and_full_logits_give_what_the_chunks_give():
    torch.manual_seed(2)
    hidden_size, vocab = 8, 30
    student_head = LogitHead(torch.randn(vocab, hidden_size), torch.randn(vocab), scale=0.5, softcap=20.0)
    teacher_head = LogitHead(torch.randn(vocab, hidden_size))
    positions = torch.tensor([[False, True, True, False], [True, True, False, False], [False, False, True, True]])
    student_hidden, teacher_hidden = torch.randn(3, 4, hidden_size), torch.randn(3, 4, hidden_size)
    tokens = torch.randint(vocab, (int(positions.sum()),))
    student_logits, teacher_logits = student_head.logits(student_hidden), teacher_head.logits(teacher_hidden)
    expected = reference(student_logits[positions], teacher_logits[positions], tokens)

    from_hidden = SampleFigures(tokens)
    picked = from_hidden.add_hidden(
        student_hidden[positions],
        student_head,
        teacher_hidden=teacher_hidden[positions],
        teacher_head=teacher_head,
        chunk_size=4,
    )
    # the teacher's log-prob of each token, as ops.topk computes it (OPD's reward reads it from this pass)
    _, _, following = topk_log_probs(teacher_hidden[positions], teacher_head, 1, next_tokens=tokens, chunk_size=4)
    assert torch.equal(picked, following)
    student_only = SampleFigures(tokens, teacher_top1=teacher_logits[positions].argmax(-1))
    assert student_only.add_hidden(student_hidden[positions], student_head, chunk_size=5) is None
    assert {name: value.item() for name, (value, _) in student_only.means().items()} == pytest.approx(
        {name: expected[name] for name in ("agreement", "entropy")}, abs=1e-5
    )
    from_logits = SampleFigures(tokens)
    from_logits.add_positions(student_logits, teacher_logits, positions, chunk_size=4)
    for figures in (from_hidden, from_logits):
        got = means(figures)
        assert {name: value for name, (value, _) in got.items()} == pytest.approx(expected, abs=1e-5)
        assert {count for _, count in got.values()} == {6}


def test_inputs_checked():
    with pytest.raises(ValueError, match="tokens must be"):
        SampleFigures(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="teacher_top1 .* must match tokens"):
        SampleFigures(torch.zeros(3, dtype=torch.long), teacher_top1=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        SampleFigures(torch.zeros(3, dtype=torch.long), k=0)
    with pytest.raises(ValueError, match="2 rows of student logits for 3 tokens"):
        SampleFigures(torch.zeros(3, dtype=torch.long)).add(slice(0, 3), torch.zeros(2, 5))
