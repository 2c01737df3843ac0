"""lightning_gkd.evaluation.completions: a model's own greedy or sampled completions and their figures."""

import math

import pytest
import torch

from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.completions import score_completions
from lightning_gkd.evaluation.metrics import evaluate_generations, exact_match
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

ROWS = addition_rows("test", 12)


@pytest.fixture(scope="module")
def toy_teacher():
    return load_causal_lm(asset_path("toy/teacher")), load_tokenizer(asset_path("toy/teacher"))


def score(model, tokenizer, **kwargs):
    return score_completions(model, tokenizer, ROWS, metric=exact_match, max_length=64, max_new_tokens=8, **kwargs)


def test_a_flat_model_writes_no_text_never_stops_and_has_the_uniform_entropy(tokenizer, student):
    """Zero logits: greedy takes id 0 (the pad token, not EOS) at every step, the text decodes empty, and each of the
    8 new tokens per row has the entropy of the uniform distribution over the 259 ids."""
    student.get_output_embeddings().weight.data.zero_()
    student.train()
    scores = score(student, tokenizer)
    assert scores.texts == [""] * len(ROWS)
    assert (scores.accuracy, scores.eos_rate, scores.mean_length) == (0.0, 0.0, 0.0)
    assert scores.entropy == pytest.approx(math.log(len(tokenizer)), rel=1e-5)
    assert student.training  # restored
    assert scores.figures() == {"accuracy": 0.0, "eos_rate": 0.0, "mean_length": 0.0, "entropy": scores.entropy}


def test_greedy_completions_score_as_the_held_out_evaluation_does(toy_teacher):
    model, tokenizer = toy_teacher
    greedy = score(model, tokenizer, batch_size=5)
    held_out = evaluate_generations(model, tokenizer, ROWS, max_new_tokens=8, max_length=64)
    assert greedy.accuracy == held_out["accuracy"] > 0.5
    assert greedy.eos_rate == 1.0  # the trained teacher stops on every row
    assert greedy.mean_length == pytest.approx(sum(len(t) for t in greedy.texts) / len(ROWS))
    assert 0 < greedy.entropy < 1


def test_sampled_completions_repeat_with_their_seed(toy_teacher):
    model, tokenizer = toy_teacher
    torch.manual_seed(123)  # the global stream plays no part
    first = score(model, tokenizer, sample_seed=3, batch_size=5)
    torch.manual_seed(7)
    assert score(model, tokenizer, sample_seed=3, batch_size=5) == first
    assert score(model, tokenizer, sample_seed=4, batch_size=5).texts != first.texts
