"""The shipped toy teacher and student start: loadable like a hub id, same tokenizer, teacher far ahead."""

import json

from lightning_gkd.data.tokenizer import build_chatml_tokenizer, load_tokenizer
from lightning_gkd.data.toy import addition_rows
from lightning_gkd.evaluation import evaluate_generations
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.models.tiny import PACKAGE_ASSETS, asset_path


def test_assets_are_small_and_described():
    size = sum(p.stat().st_size for p in (PACKAGE_ASSETS / "toy").rglob("*") if p.is_file())
    assert size < 10 * 2**20
    manifest = json.loads((PACKAGE_ASSETS / "toy" / "manifest.json").read_text())
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
