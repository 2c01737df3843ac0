"""lightning_gkd.toy.bpe: the shipped assets/toy_bpe teacher's tokenizer is what its builder learns from the task's
training text, and its manifest's pairing figures are what ``tokenizer_pairing`` computes."""

import json

from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer, build_chatml_tokenizer, load_tokenizer
from lightning_gkd.toy.bpe import tokenizer_pairing, training_corpus
from lightning_gkd.toy.tasks import toy_task
from lightning_gkd.toy.tiny import PACKAGE_ASSETS, asset_path


def manifest() -> dict:
    return json.loads((PACKAGE_ASSETS / "toy_bpe" / "manifest.json").read_text())


def test_shipped_bpe_tokenizer_is_the_one_learnt_from_the_training_rows():
    task = toy_task("addition")
    corpus = training_corpus(task)
    assert len(corpus) == len(task.rows("train"))
    assert corpus[0] == build_chatml_tokenizer().apply_chat_template(task.rows("train")[0]["messages"], tokenize=False)
    held_out = {row["messages"][0]["content"] for split in ("val", "test") for row in task.rows(split)}
    assert not any(text.split("\n")[1].removesuffix("<|im_end|>") in held_out for text in corpus)
    rebuilt = build_chatml_bpe_tokenizer(corpus, merges=manifest()["tokenizer"]["merges"])
    shipped = load_tokenizer(asset_path("toy_bpe/teacher"))
    assert rebuilt.get_vocab() == shipped.get_vocab()
    assert rebuilt.backend_tokenizer.to_str() == shipped.backend_tokenizer.to_str()


def test_manifest_pairing_figures_are_the_computed_ones():
    task = toy_task("addition")
    student = load_tokenizer(asset_path("toy/student_init"))
    teacher = load_tokenizer(asset_path("toy_bpe/teacher"))
    figures = tokenizer_pairing(student, teacher, task.rows("test"))
    assert figures == manifest()["pairing"]
    # the byte student's 259 tokens are all teacher tokens too; the teacher's merges are its own
    assert figures["shared_token_strings"] == figures["student_vocabulary"] == 259
    assert figures["teacher_tokens_per_answer"] < figures["student_tokens_per_answer"]
    assert figures["answers_split_differently"] > 0.8
