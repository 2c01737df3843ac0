"""lightning_gkd.studies.bench_models: the benchmarks' shapes, models and rows."""

import pytest

from lightning_gkd.studies.bench_models import REAL, SMALL, bench_rows, bench_shape, build_model, build_models


def test_a_shape_at_toy_sizes_keeps_its_batch_and_length_and_shrinks_the_rest():
    tiny = bench_shape("real", tiny=True)
    assert (tiny.batch, tiny.max_length, tiny.name) == (REAL.batch, REAL.max_length, "real")
    assert (tiny.vocab, tiny.new_tokens, tiny.supervised_answer) == (512, 8, 8)
    assert tiny.student["num_hidden_layers"] == tiny.teacher["num_hidden_layers"] == 1
    assert (tiny.student["hidden_size"], tiny.teacher["hidden_size"]) == (32, 64)
    assert bench_shape("small") is SMALL and SMALL.with_vocab(1024).vocab == 1024
    with pytest.raises(ValueError, match="Unknown bench shape 'huge'; use one of"):
        bench_shape("huge")


def test_models_have_the_shape_its_vocabulary_and_the_tokenizers_ids(tokenizer):
    shape = SMALL.tiny()
    student, teacher = build_models(shape, tokenizer)
    assert student.config.vocab_size == teacher.config.vocab_size == 512
    assert (student.config.hidden_size, teacher.config.hidden_size) == (32, 64)
    assert student.config.eos_token_id == tokenizer.eos_token_id and student.config.tie_word_embeddings
    again = build_model(shape.student, 512, tokenizer, seed=0)
    assert all((a == b).all() for a, b in zip(student.parameters(), again.parameters(), strict=True))


def test_rows_are_fixed_by_their_seed_and_answer_length():
    rows = bench_rows(3, answer_tokens=20)
    assert rows == bench_rows(3, answer_tokens=20) != bench_rows(3, answer_tokens=20, seed=1)
    for row in rows:
        prompt, answer = row["messages"]
        assert prompt["role"] == "user" and prompt["content"].startswith("Continue: ")
        assert answer["role"] == "assistant" and 15 <= len(answer["content"]) <= 20
