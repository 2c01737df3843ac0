"""The shipped toy teacher and student start: loadable like a hub id, same tokenizer, teacher far ahead."""

import json

import pytest
from tokenizers import Tokenizer

from lightning_gkd.data.tokenizer import build_chatml_tokenizer, load_tokenizer
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tasks import toy_task
from lightning_gkd.toy.tiny import PACKAGE_ASSETS, asset_path


@pytest.mark.parametrize("assets", ["toy", "toy_chain"])
def test_assets_are_small_and_described(assets):
    size = sum(p.stat().st_size for p in (PACKAGE_ASSETS / assets).rglob("*") if p.is_file())
    assert size < 10 * 2**20
    manifest = json.loads((PACKAGE_ASSETS / assets / "manifest.json").read_text())
    assert manifest["teacher"]["test_accuracy"] >= 0.95
    assert manifest["student_init"]["test_accuracy"] < manifest["teacher"]["test_accuracy"] - 0.3


def test_shipped_tokenizer_is_the_project_tokenizer():
    text = "<|im_start|>user\n743+58=<|im_end|>\n"
    shipped = load_tokenizer(asset_path("toy/teacher"))
    assert shipped(text)["input_ids"] == build_chatml_tokenizer()(text)["input_ids"]


def test_teacher_solves_held_out_prompts_and_the_student_does_not_yet():
    rows = addition_rows("test")[:128]
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    teacher = evaluate_generations(load_causal_lm(asset_path("toy/teacher")), tokenizer, rows, max_new_tokens=8)
    student = evaluate_generations(load_causal_lm(asset_path("toy/student_init")), tokenizer, rows, max_new_tokens=8)
    assert teacher["accuracy"] >= 0.95
    assert student["accuracy"] < 0.7


def test_chain_teacher_uses_both_orders_and_the_student_start_trails_it():
    """The chain task's teacher is right on held-out prompts and writes both valid orders (its distribution is
    bimodal at the first answer token); the student start is far behind."""
    task = toy_task("chain")
    rows = task.rows("test")[:128]
    tokenizer = load_tokenizer(asset_path("toy_chain/teacher"))
    score = dict(metrics={"accuracy": task.metric}, max_new_tokens=task.max_new_tokens, max_length=task.max_length)
    teacher = load_causal_lm(asset_path("toy_chain/teacher"))
    assert evaluate_generations(teacher, tokenizer, rows, **score)["accuracy"] >= 0.9
    student = load_causal_lm(asset_path("toy_chain/student_init"))
    assert evaluate_generations(student, tokenizer, rows, **score)["accuracy"] < 0.6
    prompt = tokenizer.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    first = teacher(input_ids=ids).logits[0, -1].softmax(-1)
    forward, backward = (tokenizer.convert_tokens_to_ids(a[0]) for a in rows[0]["answers"])
    assert forward != backward and min(first[forward], first[backward]) > 0.2


def test_bpe_teacher_asset_is_small_and_described():
    size = sum(p.stat().st_size for p in (PACKAGE_ASSETS / "toy_bpe").rglob("*") if p.is_file())
    assert size < 6 * 2**20
    manifest = json.loads((PACKAGE_ASSETS / "toy_bpe" / "manifest.json").read_text())
    assert manifest["teacher"]["test_accuracy"] >= 0.85  # the byte teacher: 0.98 (see train_toy_teacher.py)
    vocabulary = manifest["tokenizer"]["vocabulary_size"]
    assert manifest["teacher"]["config"]["vocab_size"] == vocabulary == manifest["pairing"]["teacher_vocabulary"]
    assert len(load_tokenizer(asset_path("toy_bpe/teacher"))) == vocabulary


def test_bpe_teacher_tokenizer_keeps_its_ids_through_save_and_load_and_merges_numbers(tmp_path):
    """The shipped BPE tokenizer loads (through load_tokenizer: AutoTokenizer would build Qwen2's and split digits)
    with the ids of its tokenizer.json, keeps them through save -> load, and splits text unlike the byte one."""
    folder = asset_path("toy_bpe/teacher")
    shipped = load_tokenizer(folder)
    text = "<|im_start|>user\n743+58=<|im_end|>\n<|im_start|>assistant\n5871<|im_end|>\n"
    ids = shipped(text)["input_ids"]
    assert ids == Tokenizer.from_file(f"{folder}/tokenizer.json").encode(text).ids
    shipped.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)(text)["input_ids"] == ids
    assert shipped.convert_ids_to_tokens(ids) == [
        *("<|im_start|>", "user", "Ċ", "7", "4", "3", "+", "58", "=", "<|im_end|>", "Ċ"),
        *("<|im_start|>", "assistant", "Ċ", "58", "71", "<|im_end|>", "Ċ"),
    ]
    byte_ids = build_chatml_tokenizer()(text)["input_ids"]
    assert len(byte_ids) == 32 and byte_ids != ids
    assert (shipped.eos_token, shipped.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert load_causal_lm(folder).config.vocab_size == len(shipped)


def test_bpe_teacher_answers_held_out_prompts():
    rows = addition_rows("test")[:64]
    folder = asset_path("toy_bpe/teacher")
    scores = evaluate_generations(load_causal_lm(folder), load_tokenizer(folder), rows, max_new_tokens=8)
    assert scores["accuracy"] >= 0.8


def test_the_agentic_task_assets_act_with_their_tools():
    """assets/toy_tools: the teacher succeeds with the tools on held-out rows, the student start mostly fails, and the
    shipped tokenizer's template renders the tools and keeps the call markers as single tokens."""
    from lightning_gkd.evaluation import exact_match
    from lightning_gkd.rollouts.evaluate import final_answers, rollout_rows
    from lightning_gkd.toy import tool_rows
    from lightning_gkd.toy.tools import MAX_NEW_TOKENS, task_rollout

    manifest = json.loads((PACKAGE_ASSETS / "toy_tools" / "manifest.json").read_text())
    assert manifest["teacher"]["test_success"] >= 0.95 and manifest["student_init"]["test_success"] <= 0.3
    size = sum(p.stat().st_size for p in (PACKAGE_ASSETS / "toy_tools").rglob("*") if p.is_file())
    assert size < 10 * 2**20
    tokenizer = load_tokenizer(asset_path("toy_tools/teacher"))
    assert len(tokenizer("<tool_call></tool_call>", add_special_tokens=False)["input_ids"]) == 2
    rows = tool_rows("test", 64)
    scores = {}
    for who in ("teacher", "student_init"):
        model = load_causal_lm(asset_path(f"toy_tools/{who}"))
        transcripts, _ = rollout_rows(model, tokenizer, rows, task_rollout(tokenizer), max_new_tokens=MAX_NEW_TOKENS)
        scores[who] = exact_match(final_answers(transcripts), [row["answer"] for row in rows])
    assert scores["teacher"] >= 0.95 and scores["student_init"] <= 0.4
