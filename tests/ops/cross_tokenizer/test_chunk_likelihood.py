"""ops/cross_tokenizer/chunk_likelihood.py: each aligned chunk's log-likelihood, the two-outcome JSD, the teacher's
distribution over the student's next token (hand-checked on "787"), and why they exist: on a chunk that a BPE teacher
writes as one token and a byte student as two, GOLD's hybrid pushes the student's correct first byte down, these
push it up."""

import math

import pytest
import torch

from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import (
    CrossTokenizerLoss,
    cross_tokenizer_row_terms,
    matched_vocabulary,
)
from lightning_gkd.ops.cross_tokenizer.chunk_likelihood import (
    LOG_PROB_CEILING,
    ProjectionTables,
    binary_jsd,
    chunk_log_likelihoods,
    log1mexp,
    projected_distance,
    projected_teacher_targets,
)
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss


def test_chunk_log_likelihoods_sum_the_tokens_log_probs_per_group_with_temperature():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64)
    ids = [1, 2, 3, 4, 6]
    groups = [[0], [1, 2, 3], [], [4]]  # uneven: 1, 3, 0 and 1 tokens
    log_probs = (logits / 2.0).log_softmax(-1)
    expected = [log_probs[0, 1], log_probs[1, 2] + log_probs[2, 3] + log_probs[3, 4], 0.0, log_probs[4, 6]]
    got = chunk_log_likelihoods(logits, groups, ids, temperature=2.0)
    torch.testing.assert_close(got, torch.tensor([float(v) for v in expected], dtype=torch.float64))
    assert chunk_log_likelihoods(logits.half(), groups, ids).dtype == torch.float32
    with pytest.raises(ValueError, match="token_ids has 4 ids for 5 rows"):
        chunk_log_likelihoods(logits, groups, ids[:4])
    with pytest.raises(ValueError, match=r"outside the 7 logit columns"):
        chunk_log_likelihoods(logits, groups, [1, 2, 3, 4, 7])
    with pytest.raises(ValueError, match=r"groups\[1\] holds position 5"):
        chunk_log_likelihoods(logits, [[0], [5]], ids)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_binary_jsd_is_the_generalized_jsd_of_two_bernoullis(beta):
    student = torch.tensor([0.3, 0.9, 0.05, 0.5], dtype=torch.float64)
    teacher = torch.tensor([0.6, 0.2, 0.05, 0.999], dtype=torch.float64)
    s, t = torch.stack([student, 1 - student], -1), torch.stack([teacher, 1 - teacher], -1)
    mixture = beta * t + (1 - beta) * s
    kl = lambda p, q: (p * (p / q).log()).sum(-1)  # noqa: E731
    if beta == 0.0:
        expected = kl(t, s)
    elif beta == 1.0:
        expected = kl(s, t)
    else:
        expected = beta * kl(t, mixture) + (1 - beta) * kl(s, mixture)
    torch.testing.assert_close(binary_jsd(student.log(), teacher.log(), beta), expected)
    assert binary_jsd(student.log(), student.log(), beta).abs().max() < 1e-12


def test_binary_jsd_is_finite_for_a_chunk_the_model_is_sure_of():
    student = torch.tensor([0.0, -1e-9, -30.0], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([-0.7, 0.0, -30.0], dtype=torch.float64)
    loss = binary_jsd(student, teacher, 0.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(student.grad).all()
    assert student.grad[0] > 0  # the teacher is less sure: the student's certainty goes down
    assert float(loss[1]) == pytest.approx(0.0, abs=1e-6)  # both at the ceiling
    x = torch.tensor([-1e-8, -0.5, -50.0], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x)), rtol=1e-6, atol=1e-15)
    assert LOG_PROB_CEILING == pytest.approx(math.log(1 - 1e-6))


# Teacher vocabulary "7" "8" "1" "78" "71" EOS; student vocabulary "7" "8" "1" EOS.
TOKEN_BYTES = [b"7", b"8", b"1", b"78", b"71", None]
FIRST_TOKEN = torch.tensor([0, 1, 2, 0, 0, 3])
EXTENSIONS = {b"7": (torch.tensor([3, 4]), torch.tensor([1, 2]))}  # "78" goes on with "8", "71" with "1"


def test_projected_targets_of_787_hand_checked():
    """The student's "787" + EOS is the teacher's "78", "7", EOS. After "787" the teacher's mass for "1" sits on "71"
    at the previous position, and only part of it on ending "7" there and stopping."""
    torch.manual_seed(2)
    probs = torch.rand(3, 6, dtype=torch.float64)
    probs = probs / probs.sum(-1, keepdim=True)
    positions, targets = projected_teacher_targets(
        probs,
        [3, 0, 5],
        [(0, 2), (2, 3), (3, 3)],
        [0, 1, 2, 3, 3],  # "7" "8" "7" EOS "\n": the second zero-width token gets no target
        student_vocab=4,
        tables=ProjectionTables.from_parts(FIRST_TOKEN, TOKEN_BYTES, EXTENSIONS),
    )
    assert positions.tolist() == [0, 1, 2, 3]

    def project(row: torch.Tensor) -> torch.Tensor:
        return torch.stack([row[0] + row[3] + row[4], row[1], row[2], row[5]])

    def normalised(row: torch.Tensor) -> torch.Tensor:
        return row / row.sum()

    def extended(row: torch.Tensor) -> torch.Tensor:  # "78" -> student "8", "71" -> student "1"
        return torch.stack([0 * row[0], row[3], row[4], 0 * row[0]])

    expected = torch.stack(
        [
            normalised(project(probs[0])),  # b=0: the teacher's first distribution
            normalised(extended(probs[0])),  # inside "78"
            normalised(probs[0, 3] * project(probs[1])),  # "78" ends at 2: end it, go on
            normalised(
                torch.stack([0 * probs[1, 0], probs[1, 3], probs[1, 4], 0 * probs[1, 0]])
                + probs[1, 0] * project(probs[2])
            ),
        ]
    )
    torch.testing.assert_close(targets, expected)


def test_projected_distance_is_the_generalized_jsd_against_the_targets():
    torch.manual_seed(1)
    student = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    got = projected_distance(student, targets, 0.5)
    expected = generalized_jsd_loss(student, targets.clamp_min(1e-12).log(), beta=0.5, reduction="none").sum(-1)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_on_a_chunk_split_differently_the_hybrid_pushes_the_right_first_byte_down_and_projected_pushes_it_up():
    """Student (bytes) vocabulary: "5", "8", "x"; teacher (BPE): "5", "8", "x", "58". The text is "58": one teacher
    token, two student tokens. The teacher is sure of "58", so its single-token "5" is near zero."""
    student_vocab = {"5": 0, "8": 1, "x": 2}
    teacher_vocab = {"5": 0, "8": 1, "x": 2, "58": 3}
    teacher_logits = torch.tensor([[0.0, 0.0, 0.0, 8.0]], dtype=torch.float64)
    student_logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    spans = {"student": [(0, 1), (1, 2)], "teacher": [(0, 2)]}
    matched = matched_vocabulary(student_vocab, teacher_vocab)
    projection = ProjectionTables.from_parts(  # "58" starts with "5" and goes on with "8"
        torch.tensor([0, 1, 2, 0]),
        [b"5", b"8", b"x", b"58"],
        {b"5": (torch.tensor([3]), torch.tensor([1]))},
    )
    gradients = {}
    for loss in ("hybrid", "likelihood", "projected"):
        logits = student_logits.clone().requires_grad_(True)
        value = cross_tokenizer_row_terms(
            logits,
            teacher_logits,
            [0, 1],
            [3],
            spans["student"],
            spans["teacher"],
            settings=CrossTokenizerLoss(loss=loss, beta=0.0, skip_student_eos=False, skip_teacher_eos=False),
            matched=matched,
            projection=projection,
        ).loss
        assert value.shape == (1,)
        value.sum().backward()
        gradients[loss] = logits.grad[0, 0]  # d loss / d logit of "5" at the first position
    assert gradients["hybrid"] > 0  # gradient descent lowers the student's "5"
    assert gradients["likelihood"] < 0 and gradients["projected"] < gradients["likelihood"]
    with pytest.raises(ValueError, match="needs the projection tables"):
        cross_tokenizer_row_terms(
            student_logits,
            teacher_logits,
            [0, 1],
            [3],
            spans["student"],
            spans["teacher"],
            settings=CrossTokenizerLoss(loss="projected"),
            matched=None,
        )


# --------------------------------------------------------------------------- the vectorised batch path


@pytest.fixture(scope="module")
def tokenizer_pairs():
    from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer, build_chatml_tokenizer
    from tests.helpers.sentencepiece_style import sentencepiece_style_tokenizer

    byte = build_chatml_tokenizer()
    bpe = build_chatml_bpe_tokenizer(["café café 漢字 漢字 a   b\n\n x\n  y 7871 787 58 5858"] * 4, merges=40)
    return {"bpe": (byte, bpe), "metaspace": (byte, sentencepiece_style_tokenizer("metaspace")), "same": (byte, byte)}


def _completion(tokenizer, text: str, end_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``text``'s ids and byte spans, then ``end_tokens`` zero-width end tokens (EOS, ``"\\n"``)."""
    from lightning_gkd.data.retokenize import _TokenBytes

    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    spans, end = [], 0
    for piece in _TokenBytes(tokenizer).content_pieces(ids) if ids else []:
        spans.append((end, end + len(piece)))
        end += len(piece)
    tail = [tokenizer.eos_token_id, tokenizer.eos_token_id][:end_tokens]
    return ids + tail, spans + [(end, end)] * len(tail)


@pytest.mark.parametrize("pair", ["bpe", "metaspace", "same"])
@pytest.mark.parametrize(
    "settings",
    [
        CrossTokenizerLoss(loss="projected"),
        CrossTokenizerLoss(loss="likelihood"),
        CrossTokenizerLoss(loss="projected", skip_student_eos=True, beta=0.5, student_temperature=2.0),
        CrossTokenizerLoss(loss="projected", alignment="positions", skip_teacher_eos=True, teacher_temperature=0.7),
        CrossTokenizerLoss(loss="likelihood", alignment="positions", beta=1.0),
    ],
    ids=["projected", "likelihood", "projected-skip-beta", "projected-positions", "likelihood-positions"],
)
def test_batch_loss_equals_the_per_token_reference_over_uneven_rows(tokenizer_pairs, pair, settings):
    """``cross_tokenizer_batch_loss`` (vectorised over all rows' tokens, the projected part in chunks of 3 positions)
    against the per-token loops it replaced (tests/helpers/cross_tokenizer_reference.py), row by row: the same groups,
    values and gradients (float64; equal up to the last bits of vectorised transcendental functions)."""
    from lightning_gkd.data.token_projection import projection_tables
    from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import cross_tokenizer_batch_loss
    from tests.helpers.cross_tokenizer_reference import reference_row_terms, reference_tables

    student, teacher = tokenizer_pairs[pair]
    parts = reference_tables(student, teacher)
    tables = projection_tables(student, teacher)
    assert torch.equal(tables.first_token, parts[0])  # the tables equal the token-by-token ones
    reference = ProjectionTables.from_parts(*parts)
    assert all(torch.equal(getattr(tables, f), getattr(reference, f)) for f in ("cut_prefix", "extension_ids"))
    texts = ["café 7871 漢字", "a   b\n\n x", "787", "", "58 5858 café\n  y", "7"]
    ends = [2, 1, 0, 2, 1, 2]  # uneven end tokens (a sample cut without EOS: 0)
    rows_s = [_completion(student, text, end) for text, end in zip(texts, ends, strict=True)]
    rows_t = [_completion(teacher, text, max(end - 1, 0)) for text, end in zip(texts, ends, strict=True)]
    torch.manual_seed(0)
    s_logits = torch.randn(sum(len(ids) for ids, _ in rows_s), len(student), dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(sum(len(ids) for ids, _ in rows_t), len(teacher) + 3, dtype=torch.float64)
    got = cross_tokenizer_batch_loss(
        s_logits,
        t_logits,
        [ids for ids, _ in rows_s],
        [ids for ids, _ in rows_t],
        [spans for _, spans in rows_s],
        [spans for _, spans in rows_t],
        settings=settings,
        projection=tables,
        chunk_elements=3 * len(student),
    )
    (got_grad,) = torch.autograd.grad(got.mean(), s_logits)
    expected, s_at, t_at = [], 0, 0
    for (s_ids, s_spans), (t_ids, t_spans) in zip(rows_s, rows_t, strict=True):
        expected.append(
            reference_row_terms(
                s_logits[s_at : s_at + len(s_ids)],
                t_logits[t_at : t_at + len(t_ids)],
                s_ids,
                t_ids,
                s_spans,
                t_spans,
                settings=settings,
                parts=parts,
            )
        )
        s_at, t_at = s_at + len(s_ids), t_at + len(t_ids)
    reference = torch.cat(expected)
    (reference_grad,) = torch.autograd.grad(reference.mean(), s_logits)
    assert got.shape == reference.shape and got.numel() > 5
    torch.testing.assert_close(got, reference, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(got_grad, reference_grad, rtol=1e-12, atol=1e-15)
    assert got_grad.abs().sum() > 0


def test_batch_loss_in_float32_matches_the_reference_to_rounding(tokenizer_pairs):
    from lightning_gkd.data.token_projection import projection_tables
    from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import cross_tokenizer_batch_loss
    from tests.helpers.cross_tokenizer_reference import reference_row_terms, reference_tables

    student, teacher = tokenizer_pairs["bpe"]
    parts, tables = reference_tables(student, teacher), projection_tables(student, teacher)
    rows_s = [_completion(student, text, 2) for text in ("café 7871", "58 58")]
    rows_t = [_completion(teacher, text, 1) for text in ("café 7871", "58 58")]
    torch.manual_seed(1)
    s_logits = torch.randn(sum(len(ids) for ids, _ in rows_s), len(student))
    t_logits = torch.randn(sum(len(ids) for ids, _ in rows_t), len(teacher))
    settings = CrossTokenizerLoss(loss="projected")
    got = cross_tokenizer_batch_loss(
        s_logits,
        t_logits,
        [r[0] for r in rows_s],
        [r[0] for r in rows_t],
        [r[1] for r in rows_s],
        [r[1] for r in rows_t],
        settings=settings,
        projection=tables,
    )
    split_s = s_logits.split([len(r[0]) for r in rows_s])
    split_t = t_logits.split([len(r[0]) for r in rows_t])
    reference = torch.cat(
        [
            reference_row_terms(s, t, rs[0], rt[0], rs[1], rt[1], settings=settings, parts=parts)
            for s, t, rs, rt in zip(split_s, split_t, rows_s, rows_t, strict=True)
        ]
    )
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-7)


def test_batch_loss_rejects_malformed_spans_and_lengths():
    from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import cross_tokenizer_batch_loss

    settings = CrossTokenizerLoss(loss="likelihood")
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="ends that never go back"):
        cross_tokenizer_batch_loss(
            logits, logits, [[0, 1]], [[0, 1]], [[(0, 2), (0, 1)]], [[(0, 1), (1, 2)]], settings=settings
        )
    with pytest.raises(ValueError, match="2 logit rows, 1 token ids"):
        cross_tokenizer_batch_loss(logits, logits, [[0]], [[0, 1]], [[(0, 1)]], [[(0, 1), (1, 2)]], settings=settings)
