"""Tests for lightning_gkd.ops.cross_tokenizer.aligned_row_loss: hand-checked alignment, merging and distances, the
identical-vocabulary limit (== generalized_jsd_loss), and parity with TRL 1.16's GOLD ULDLoss."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import (
    CrossTokenizerLoss,
    align_byte_spans,
    cross_tokenizer_row_terms,
    end_token_count,
    hybrid_distance,
    hybrid_terms,
    matched_vocabulary,
    merge_group_probs,
    uld_distance,
)
from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss

F64 = torch.float64

#: TRL's GOLDTrainer defaults (the hybrid loss, end tokens left out); ours default to loss="projected" with the end
#: tokens in
GOLD = partial(CrossTokenizerLoss, loss="hybrid", skip_student_eos=True, skip_teacher_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: a thread pool only adds contention (5x slower on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- align_byte_spans


@pytest.mark.parametrize(
    "student, teacher, expected",
    [
        pytest.param([(0, 1), (1, 3)], [(0, 1), (1, 3)], ([[0], [1]], [[0], [1]]), id="one-to-one"),
        pytest.param([(0, 1), (1, 2), (2, 4)], [(0, 2), (2, 4)], ([[0, 1], [2]], [[0], [1]]), id="many-to-one"),
        pytest.param([(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)], ([[0], [1]], [[0, 1], [2]]), id="one-to-many"),
        pytest.param([(0, 2), (2, 4)], [(0, 1), (1, 4)], ([[0, 1]], [[0, 1]]), id="interleaved"),
        pytest.param(
            [(0, 3), (3, 3), (3, 3)],  # content, <|im_end|>, "\n"
            [(0, 1), (1, 3), (3, 3)],  # content, content, EOS
            ([[0], [1], [2]], [[0, 1], [2], []]),
            id="zero-width-end-tokens",
        ),
        pytest.param([(0, 2), (2, 5)], [(0, 2), (2, 4)], ([[0], [1]], [[0], [1]]), id="leftover-tail"),
        pytest.param([(0, 2), (2, 3), (3, 6)], [(0, 2), (2, 4)], ([[0], [1, 2]], [[0], [1]]), id="tail-both-sides"),
        pytest.param([], [(0, 1)], ([[]], [[0]]), id="one-side-empty"),
        pytest.param([], [], ([], []), id="both-empty"),
    ],
)
def test_align_byte_spans_hand_checked(student, teacher, expected) -> None:
    assert align_byte_spans(student, teacher) == expected


@pytest.mark.parametrize(
    "spans, message",
    [
        ([(0, 2), (3, 1)], r"student_spans\[1\] = \(3, 1\): a byte span needs 0 <= start <= end"),
        ([(0, 3), (1, 2)], r"student_spans\[1\] ends at byte 2, before the previous token's end 3"),
        ([(0, 1, 2)], r"student_spans\[0\] = \(0, 1, 2\) is not a \(start, end\) byte pair"),
    ],
)
def test_align_byte_spans_rejects_malformed_spans(spans, message) -> None:
    with pytest.raises(ValueError, match=message):
        align_byte_spans(spans, [(0, 3)])


@pytest.mark.parametrize(
    "spans, count",
    [
        ([(0, 3), (3, 3), (3, 3)], 2),  # ChatML: <|im_end|>, "\n"
        ([(0, 3), (3, 3)], 1),
        ([(0, 2), (2, 3)], 0),  # cut at max_new_tokens: no EOS
        ([(0, 0)], 1),  # empty content
        ([], 0),
    ],
)
def test_end_token_count(spans, count) -> None:
    assert end_token_count(spans) == count


# --------------------------------------------------------------------------- merge_group_probs

_PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.125, 0.125], [0.7, 0.1, 0.1, 0.1]], dtype=F64)
_IDS = [3, 1, 0]


@pytest.mark.parametrize(
    "strategy, groups, expected",
    [
        # observed: first row x p(later actual tokens); bayesian: last row x p(earlier actual tokens)
        ("observed", [[0, 1], [2]], [[0.025, 0.05, 0.075, 0.1], [0.7, 0.1, 0.1, 0.1]]),
        ("bayesian", [[0, 1], [2]], [[0.2, 0.1, 0.05, 0.05], [0.7, 0.1, 0.1, 0.1]]),
        ("observed", [[0, 1, 2]], [[0.1 * 0.175, 0.2 * 0.175, 0.3 * 0.175, 0.4 * 0.175]]),
        ("bayesian", [[0, 1, 2]], [[0.07, 0.01, 0.01, 0.01]]),
        ("observed", [[0], [], [1]], [[0.1, 0.2, 0.3, 0.4], [0, 0, 0, 0], [0.5, 0.25, 0.125, 0.125]]),
    ],
)
def test_merge_group_probs_hand_checked(strategy, groups, expected) -> None:
    merged = merge_group_probs(_PROBS, groups, _IDS, strategy)
    torch.testing.assert_close(merged, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-15)


def test_merge_clamps_a_zero_token_probability_at_1e_8() -> None:
    probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]], dtype=F64)
    merged = merge_group_probs(probs, [[0, 1]], [0, 1], "observed")  # token 1 at position 1 has probability 0
    torch.testing.assert_close(merged, torch.tensor([[0.5e-8, 0.5e-8]], dtype=F64), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "groups, ids, message",
    [
        ([[0, 3]], _IDS, r"groups\[0\] holds position 3, outside the 3 rows of probs"),
        ([[0, 1]], [3, 9, 0], r"token_ids\[1\] = 9 is outside the vocabulary of probs \(size 4\)"),
        ([[0]], [3, 1], r"token_ids has 2 ids for 3 rows of probs"),
    ],
)
def test_merge_rejects_bad_indices(groups, ids, message) -> None:
    with pytest.raises(ValueError, match=message):
        merge_group_probs(_PROBS, groups, ids, "observed")


# --------------------------------------------------------------------------- uld_distance


def test_uld_distance_hand_checked_with_different_vocabulary_sizes() -> None:
    student = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.3, 0.5]], dtype=F64)
    teacher = torch.tensor([[0.1, 0.6, 0.25, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=F64)
    # sorted: (.7 .2 .1 0) vs (.6 .25 .1 .05) -> .1 + .05 + 0 + .05; (.5 .3 .2 0) vs (.25 x 4) -> .25 + .05 + .05 + .25
    expected = torch.tensor([0.2, 0.6], dtype=F64)
    torch.testing.assert_close(uld_distance(student, teacher), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(uld_distance(teacher, student), expected, rtol=0, atol=1e-15)


def test_uld_distance_is_invariant_to_permuting_either_vocabulary() -> None:
    g = torch.Generator().manual_seed(0)
    student = torch.randn(5, 7, generator=g, dtype=F64).softmax(-1)
    teacher = torch.randn(5, 11, generator=g, dtype=F64).softmax(-1)
    base = uld_distance(student, teacher)
    permuted = uld_distance(student[:, torch.randperm(7, generator=g)], teacher[:, torch.randperm(11, generator=g)])
    torch.testing.assert_close(permuted, base, rtol=0, atol=1e-15)
    assert (base > 0).all()
    torch.testing.assert_close(uld_distance(student, student), torch.zeros(5, dtype=F64))


def test_chunked_distances_equal_one_pass_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(1)
    s_logits = torch.randn(7, 9, generator=g, dtype=F64, requires_grad=True)
    t_logits = torch.randn(7, 12, generator=g, dtype=F64, requires_grad=True)
    matched = (torch.tensor([0, 3, 4, 8]), torch.tensor([1, 2, 5, 11]))
    for fn in (
        lambda s, t, c: uld_distance(s, t, chunk_size=c),
        lambda s, t, c: hybrid_distance(s, t, *matched, beta=0.3, chunk_size=c),
    ):
        results = []
        for chunk in (None, 2):  # None: one pass; 2: four chunks, checkpointed
            out = fn(s_logits.softmax(-1), t_logits.softmax(-1), chunk)
            grads = torch.autograd.grad((out * torch.arange(1.0, 8.0, dtype=F64)).sum(), (s_logits, t_logits))
            results.append((out, *grads))
        for one, chunked in zip(*results, strict=True):
            torch.testing.assert_close(chunked, one, rtol=0, atol=1e-14)


# --------------------------------------------------------------------------- matched_vocabulary / hybrid


def test_matched_vocabulary_pairs_shared_strings_sorted_by_teacher_id() -> None:
    student = {"a": 0, "b": 1, "c": 2, "Ġthe": 3, "x": 4}
    teacher = {"Ġthe": 0, "z": 1, "c": 2, "a": 5, "y": 3}
    s_ids, t_ids = matched_vocabulary(student, teacher)
    assert t_ids.tolist() == [0, 2, 5] and s_ids.tolist() == [3, 2, 0]
    assert s_ids.dtype == t_ids.dtype == torch.long
    empty = matched_vocabulary({"a": 0}, {"b": 0})
    assert empty[0].numel() == empty[1].numel() == 0


def test_matched_vocabulary_keeps_pairs_one_to_one() -> None:
    # two teacher strings on one id, two student strings on one id
    s_ids, t_ids = matched_vocabulary({"a": 0, "b": 0, "c": 1}, {"a": 2, "b": 1, "c": 1})
    # candidate (teacher, student) pairs (1, 0) "b", (1, 1) "c", (2, 0) "a": the first takes both ids
    assert t_ids.tolist() == [1] and s_ids.tolist() == [0]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("divergence", ["clamped", "renormalised"])
def test_hybrid_with_identical_vocabularies_is_the_generalized_jsd(beta: float, divergence: str) -> None:
    g = torch.Generator().manual_seed(2)
    s_logits = (2 * torch.randn(6, 9, generator=g, dtype=F64)).requires_grad_()
    t_logits = (2 * torch.randn(6, 9, generator=g, dtype=F64)).requires_grad_()
    everything = (torch.arange(9), torch.arange(9))
    ours = hybrid_distance(
        s_logits.softmax(-1), t_logits.softmax(-1), *everything, beta=beta, matched_divergence=divergence
    )
    reference = generalized_jsd_loss(s_logits, t_logits, beta=beta, reduction="none").sum(-1)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-13)
    weights = torch.arange(1.0, 7.0, dtype=F64)
    ours_grads = torch.autograd.grad((ours * weights).sum(), (s_logits, t_logits))
    reference_grads = torch.autograd.grad((reference * weights).sum(), (s_logits, t_logits))
    for mine, theirs in zip(ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-13)


def test_hybrid_parts_and_weights_hand_checked() -> None:
    # student columns 0, 1 matched to teacher columns 1, 0; student 2 and teacher 2, 3 unmatched
    student = torch.tensor([[0.5, 0.25, 0.25]], dtype=F64)
    teacher = torch.tensor([[0.25, 0.5, 0.15, 0.1]], dtype=F64)
    ids = (torch.tensor([0, 1]), torch.tensor([1, 0]))
    matched, unmatched = hybrid_terms(student, teacher, *ids, beta=0.0)
    # forward KL on the (unnormalised) matched columns: identical -> 0; sorted L1 (.25 0) vs (.15 .1) -> .1 + .1
    torch.testing.assert_close(matched, torch.zeros(1, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(unmatched, torch.tensor([0.2], dtype=F64), rtol=0, atol=1e-15)
    adaptive = hybrid_distance(student, teacher, *ids, beta=0.0)  # w_m = 2 / 4
    torch.testing.assert_close(adaptive, torch.tensor([0.5 * 0.2], dtype=F64), rtol=0, atol=1e-15)
    fixed = hybrid_distance(student, teacher, *ids, beta=0.0, matched_weight=1.0, unmatched_weight=3.0)
    torch.testing.assert_close(fixed, torch.tensor([0.6], dtype=F64), rtol=0, atol=1e-15)


def test_hybrid_without_shared_strings_is_uld() -> None:
    g = torch.Generator().manual_seed(3)
    student = torch.randn(4, 5, generator=g, dtype=F64).softmax(-1)
    teacher = torch.randn(4, 8, generator=g, dtype=F64).softmax(-1)
    none = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    torch.testing.assert_close(hybrid_distance(student, teacher, *none, beta=0.5), uld_distance(student, teacher))


def test_hybrid_rejects_matched_ids_beyond_the_logits() -> None:
    probs = torch.full((1, 4), 0.25)
    with pytest.raises(ValueError, match=r"teacher_ids holds ids in \[0, 6\], outside the teacher's 4 logit columns"):
        hybrid_distance(probs, probs, torch.tensor([0, 1]), torch.tensor([0, 6]), beta=0.5)


# --------------------------------------------------------------------------- settings and one row


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"loss": "gold"},
            r"cross_tokenizer.loss must be one of \('hybrid', 'uld', 'likelihood', 'projected'\), got 'gold'",
        ),
        ({"merge": "first"}, r"cross_tokenizer.merge must be one of \('observed', 'bayesian'\)"),
        ({"alignment": "chars"}, r"cross_tokenizer.alignment must be one of \('bytes', 'positions'\)"),
        ({"beta": 1.5}, r"cross_tokenizer.beta must be in \[0, 1\]"),
        ({"teacher_temperature": 0.0}, r"cross_tokenizer.teacher_temperature must be a finite number > 0, got 0.0"),
        ({"matched_weight": 0.5}, r"matched_weight and cross_tokenizer.unmatched_weight go together"),
        ({"loss": "uld", "matched_weight": 0.5, "unmatched_weight": 0.5}, r"with loss='uld' they have no effect"),
        (
            {"loss": "hybrid", "matched_weight": -1.0, "unmatched_weight": 0.5},
            r"matched_weight must be a finite number >= 0",
        ),
    ],
)
def test_settings_errors_name_the_option(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        CrossTokenizerLoss(**kwargs)


def test_hybrid_row_without_matched_vocabulary_says_what_to_pass() -> None:
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"needs the matched vocabulary: pass matched=matched_vocabulary\("):
        cross_tokenizer_row_terms(
            logits,
            logits,
            [0, 1],
            [0, 1],
            [(0, 1), (1, 1)],
            [(0, 1), (1, 1)],
            settings=GOLD(),
            matched=None,
        )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_row_with_identical_tokenizers_is_plain_gkd(beta: float) -> None:
    """Same ids, spans and vocabulary, end tokens kept: every group is one token and the hybrid is all matched."""
    g = torch.Generator().manual_seed(4)
    s_logits = torch.randn(5, 9, generator=g, dtype=F64).requires_grad_()
    t_logits = torch.randn(5, 9, generator=g, dtype=F64).requires_grad_()
    ids, spans = [3, 1, 4, 1, 5], [(0, 1), (1, 3), (3, 4), (4, 6), (6, 6)]
    settings = GOLD(
        beta=beta, student_temperature=1.7, teacher_temperature=1.7, skip_student_eos=False, skip_teacher_eos=False
    )
    vocab = {f"t{i}": i for i in range(9)}
    ours = cross_tokenizer_row_terms(
        s_logits, t_logits, ids, ids, spans, spans, settings=settings, matched=matched_vocabulary(vocab, vocab)
    ).loss
    reference = generalized_jsd_loss(s_logits, t_logits, beta=beta, temperature=1.7, reduction="none").sum(-1)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-13)
    ours_grads = torch.autograd.grad(ours.mean(), (s_logits, t_logits))
    reference_grads = torch.autograd.grad(reference.mean(), (s_logits, t_logits))
    for mine, theirs in zip(ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-13)


def test_row_skips_every_end_token_and_upcasts_half_precision() -> None:
    g = torch.Generator().manual_seed(5)
    s_logits = torch.randn(4, 6, generator=g).bfloat16()
    t_logits = torch.randn(3, 8, generator=g).bfloat16()
    s_spans = [(0, 2), (2, 3), (3, 3), (3, 3)]  # content, content, <|im_end|>, "\n"
    t_spans = [(0, 3), (3, 3)]
    settings = GOLD(loss="uld")
    terms = cross_tokenizer_row_terms(
        s_logits, t_logits[:2], [1, 2, 3, 4], [5, 6], s_spans, t_spans, settings=settings, matched=None
    )
    assert terms.matched is None and terms.unmatched is None
    assert terms.loss.dtype == torch.float32 and terms.loss.shape == (1,)  # one group: student [0, 1], teacher [0]
    merged = merge_group_probs(s_logits[:2].float().softmax(-1), [[0, 1]], [1, 2], "observed")
    expected = uld_distance(merged, t_logits[:1].float().softmax(-1))
    torch.testing.assert_close(terms.loss, expected)


@pytest.mark.parametrize("skip, groups", [(True, 2), (False, 4)])
def test_positions_alignment_pairs_the_first_tokens_after_skipping_every_end_token(skip: bool, groups: int) -> None:
    g = torch.Generator().manual_seed(6)
    s_logits, t_logits = torch.randn(4, 6, generator=g, dtype=F64), torch.randn(5, 8, generator=g, dtype=F64)
    s_spans = [(0, 1), (1, 3), (3, 3), (3, 3)]  # 2 content tokens, <|im_end|>, "\n"
    t_spans = [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]  # 3 content tokens, 2 end tokens
    settings = GOLD(loss="uld", alignment="positions", skip_student_eos=skip, skip_teacher_eos=skip)
    ours = cross_tokenizer_row_terms(
        s_logits, t_logits, [0] * 4, [0] * 5, s_spans, t_spans, settings=settings, matched=None
    ).loss
    expected = uld_distance(s_logits[:groups].softmax(-1), t_logits[:groups].softmax(-1))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-15)


# --------------------------------------------------------------------------- parity with TRL's GOLD ULDLoss

VS, VT, VT_LOGITS = 15, 19, 20  # the teacher's logits are one column wider than its vocabulary (padding)


def _vocabularies() -> tuple[dict[str, int], dict[str, int]]:
    """Two made-up vocabularies sharing six strings at different ids."""
    rng = random.Random(0)
    shared = [f"shared{i}" for i in range(6)]
    student = [*shared, *(f"student{i}" for i in range(VS - 6))]
    teacher = [*shared, *(f"teacher{i}" for i in range(VT - 6))]
    rng.shuffle(student)
    rng.shuffle(teacher)
    return {s: i for i, s in enumerate(student)}, {s: i for i, s in enumerate(teacher)}


@dataclass
class _Row:
    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    student_ids: list[int]
    teacher_ids: list[int]
    student_spans: list[tuple[int, int]]
    teacher_spans: list[tuple[int, int]]


def _partition(rng: random.Random, length: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    while start < length:
        end = min(length, start + rng.randint(1, 3))
        spans.append((start, end))
        start = end
    return spans


def _rows(dtype: torch.dtype, *, student_end_tokens: int = 1, seed: int = 0) -> list[_Row]:
    """Random completions of the same content: each side a random partition of its bytes, then its end tokens."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in (9, 14, 5, 11):
        s_spans = _partition(rng, length) + [(length, length)] * student_end_tokens
        t_spans = _partition(rng, length) + [(length, length)]
        rows.append(
            _Row(
                (2.5 * torch.randn(len(s_spans), VS, generator=g, dtype=F64)).to(dtype),
                (2.5 * torch.randn(len(t_spans), VT_LOGITS, generator=g, dtype=F64)).to(dtype),
                [rng.randrange(VS) for _ in s_spans],
                [rng.randrange(VT) for _ in t_spans],
                s_spans,
                t_spans,
            )
        )
    return rows


@pytest.fixture(scope="module")
def vocabularies():
    return _vocabularies()


@pytest.fixture(scope="module")
def trl_factory(vocabularies, tmp_path_factory):
    pytest.importorskip("trl")
    from helpers.trl_gold import trl_uld_loss

    output_dir = tmp_path_factory.mktemp("gold")
    student_vocab, teacher_vocab = vocabularies
    return lambda settings: trl_uld_loss(
        settings, student_vocab=student_vocab, teacher_vocab=teacher_vocab, output_dir=output_dir
    )


def _row_parity(settings: CrossTokenizerLoss, rows: list[_Row], trl_factory, vocabularies) -> float:
    """Max |ours - TRL| over the rows' losses and both logits' gradients; asserts each within 1e-5."""
    from helpers.trl_gold import trl_row_loss

    uld = trl_factory(settings)
    matched = matched_vocabulary(*vocabularies)
    worst = 0.0
    for row in rows:
        ours_in = (row.student_logits.clone().requires_grad_(), row.teacher_logits.clone().requires_grad_())
        trl_in = (row.student_logits.clone().requires_grad_(), row.teacher_logits.clone().requires_grad_())
        ids_and_spans = (row.student_ids, row.teacher_ids, row.student_spans, row.teacher_spans)
        ours = cross_tokenizer_row_terms(*ours_in, *ids_and_spans, settings=settings, matched=matched).loss.mean()
        theirs = trl_row_loss(uld, *trl_in, *ids_and_spans)
        ours_grads = torch.autograd.grad(ours, ours_in)
        trl_grads = torch.autograd.grad(theirs, trl_in)
        torch.testing.assert_close(ours, theirs.reshape(()), rtol=0, atol=1e-5)
        worst = max(worst, abs(ours.item() - theirs.item()))
        for mine, reference in zip(ours_grads, trl_grads, strict=True):
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)
            worst = max(worst, (mine - reference).abs().max().item())
    return worst


_SETTINGS = [
    GOLD(
        loss=loss,
        alignment=alignment,
        merge=merge,
        beta=beta,
        student_temperature=temperatures[0],
        teacher_temperature=temperatures[1],
        skip_student_eos=skips[0],
        skip_teacher_eos=skips[1],
    )
    for (loss, beta), alignment, merge, skips, temperatures in itertools.product(
        [("uld", 0.5), ("hybrid", 0.5), ("hybrid", 0.0), ("hybrid", 1.0)],
        ["bytes", "positions"],
        ["observed", "bayesian"],
        [(True, True), (False, False), (True, False), (False, True)],
        [(1.0, 1.0), (0.7, 2.0)],
    )
] + [
    GOLD(alignment=alignment, merge=merge, matched_weight=0.3, unmatched_weight=1.7)
    for alignment, merge in itertools.product(["bytes", "positions"], ["observed", "bayesian"])
]


def _settings_id(s: CrossTokenizerLoss) -> str:
    weights = f"-w{s.matched_weight},{s.unmatched_weight}" if s.matched_weight is not None else ""
    return (
        f"{s.loss}-b{s.beta}-{s.alignment}-{s.merge}-skip{int(s.skip_student_eos)}{int(s.skip_teacher_eos)}"
        f"-T{s.student_temperature},{s.teacher_temperature}{weights}"
    )


@pytest.mark.parametrize("settings", _SETTINGS, ids=[_settings_id(s) for s in _SETTINGS])
def test_row_loss_and_gradients_equal_trl(settings, trl_factory, vocabularies) -> None:
    assert _row_parity(settings, _rows(F64), trl_factory, vocabularies) < 1e-12


@pytest.mark.parametrize(
    "loss, alignment, merge",
    list(itertools.product(["uld", "hybrid"], ["bytes", "positions"], ["observed", "bayesian"])),
)
def test_row_loss_equals_trl_in_float32(loss, alignment, merge, trl_factory, vocabularies) -> None:
    settings = GOLD(loss=loss, alignment=alignment, merge=merge, student_temperature=0.8)
    _row_parity(settings, _rows(torch.float32, seed=1), trl_factory, vocabularies)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("merge", ["observed", "bayesian"])
def test_byte_alignment_equals_trl_with_chatml_end_tokens(skip, merge, trl_factory, vocabularies) -> None:
    """Two student end tokens (<|im_end|>, "\\n") against the teacher's one EOS: TRL skips only the last position,
    we skip both, and the extra one falls into a tail group with an empty side that both drop."""
    settings = GOLD(merge=merge, skip_student_eos=skip, skip_teacher_eos=skip)
    assert _row_parity(settings, _rows(F64, student_end_tokens=2, seed=2), trl_factory, vocabularies) < 1e-12


def test_hybrid_unmatched_part_is_zero_when_one_side_has_no_unmatched_column(tmp_path) -> None:
    """The teacher's vocabulary is inside the student's: TRL (and we) give the student's extra columns no ULD term."""
    pytest.importorskip("trl")
    from helpers.trl_gold import trl_uld_loss

    student_vocab, teacher_vocab = {"a": 0, "b": 1, "c": 2}, {"b": 0, "a": 1}
    settings = GOLD(matched_weight=0.5, unmatched_weight=0.5)
    uld = trl_uld_loss(settings, student_vocab=student_vocab, teacher_vocab=teacher_vocab, output_dir=tmp_path)
    student = torch.tensor([[0.5, 0.3, 0.2]], dtype=F64)
    teacher = torch.tensor([[0.6, 0.4]], dtype=F64)
    matched = matched_vocabulary(student_vocab, teacher_vocab)
    parts = hybrid_terms(student, teacher, *matched, beta=0.5)
    assert parts[1].tolist() == [0.0]
    ours = hybrid_distance(student, teacher, *matched, beta=0.5, matched_weight=0.5, unmatched_weight=0.5)
    torch.testing.assert_close(ours, 0.5 * parts[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[0], uld._compute_hybrid_uld_loss(student, teacher), rtol=0, atol=1e-15)


def test_alignment_merge_and_hybrid_per_group_equal_trl(trl_factory, vocabularies) -> None:
    matched = matched_vocabulary(*vocabularies)
    for row, merge in itertools.product(_rows(F64, seed=3), ["observed", "bayesian"]):
        uld = trl_factory(GOLD(merge=merge, beta=0.3))
        assert uld._teacher_matched_ids == set(matched[1].tolist())
        assert [int(uld.mapping_tensor[t]) for t in matched[1]] == matched[0].tolist()
        groups = align_byte_spans(row.student_spans, row.teacher_spans)
        assert groups == uld._align_by_byte_offsets(row.student_spans, row.teacher_spans)
        pairs = [(s, t) for s, t in zip(*groups, strict=True) if s and t]
        s_probs, t_probs = row.student_logits.softmax(-1), row.teacher_logits.softmax(-1)
        s_merged = merge_group_probs(s_probs, [s for s, _ in pairs], row.student_ids, merge)
        t_merged = merge_group_probs(t_probs, [t for _, t in pairs], row.teacher_ids, merge)
        trl_s = uld._merge_probabilities_with_alignment_groups(s_probs, [s for s, _ in pairs], row.student_ids)
        trl_t = uld._merge_probabilities_with_alignment_groups(t_probs, [t for _, t in pairs], row.teacher_ids)
        torch.testing.assert_close(s_merged, trl_s, rtol=1e-13, atol=1e-16)
        torch.testing.assert_close(t_merged, trl_t, rtol=1e-13, atol=1e-16)
        ours = hybrid_distance(s_merged, t_merged, *matched, beta=0.3)
        theirs = torch.stack(
            [uld._compute_hybrid_uld_loss(s_merged[g : g + 1], t_merged[g : g + 1]) for g in range(len(pairs))]
        )
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-13)
