"""SFTModule, generation metrics, the toy task and the held-out evaluation callback."""

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule, SFTModule
from lightning_gkd.callbacks.held_out_eval import HeldOutEvaluation
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.evaluation import decode_until_eos, evaluate_generations, exact_match, reference_texts
from lightning_gkd.toy import addition_row, addition_rows


def test_toy_rows_are_reversed_sums_with_disjoint_fixed_splits():
    assert addition_row(347, 85)["messages"] == [
        {"role": "user", "content": "743+58="},
        {"role": "assistant", "content": "234"},
    ]
    splits = {name: addition_rows(name) for name in ("train", "val", "test")}
    assert {k: len(v) for k, v in splits.items()} == {"train": 20000, "val": 256, "test": 512}
    prompts = {k: {r["messages"][0]["content"] for r in v} for k, v in splits.items()}
    assert not (prompts["train"] & prompts["test"]) and not (prompts["train"] & prompts["val"])
    assert not (prompts["val"] & prompts["test"])
    assert addition_rows("test") == splits["test"] and addition_rows("train", 10) == splits["train"][:10]
    for row in splits["test"][:50]:
        a, b = (int(x[::-1]) for x in row["messages"][0]["content"].rstrip("=").split("+"))
        assert int(row["answer"][::-1]) == a + b


def test_exact_match_and_decoding(tokenizer):
    assert exact_match(["12", " 3", "4"], ["12", "3", "5"]) == pytest.approx(2 / 3)
    ids = tokenizer("12<|im_end|>\n9", add_special_tokens=False)["input_ids"]
    assert decode_until_eos(tokenizer, [ids], tokenizer.eos_token_id) == ["12"]
    batch = ChatMLCollator(tokenizer)([addition_row(347, 85), addition_row(1, 2)])
    assert reference_texts(tokenizer, batch, tokenizer.eos_token_id) == ["234", "3"]


def test_evaluate_generations_applies_every_metric(student, tokenizer):
    rows = addition_rows("test", 8)
    scores = evaluate_generations(
        student,
        tokenizer,
        rows,
        max_new_tokens=6,
        metrics={"accuracy": exact_match, "count": lambda predictions, references: float(len(predictions))},
    )
    assert scores["count"] == 8.0 and 0.0 <= scores["accuracy"] <= 1.0


def test_sft_loss_is_cross_entropy_on_completion_tokens(student, tokenizer):
    module = SFTModule(student, tokenizer)
    batch = ChatMLCollator(tokenizer)([addition_row(347, 85), addition_row(12, 9)])
    assert batch["attention_mask"][0].all() and not batch["attention_mask"][1].all()
    logits = student(input_ids=batch["input_ids"][:1]).logits  # the unpadded (longest) row alone
    labels = batch["labels"][:1]
    expected = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    single = {k: v[:1] for k, v in batch.items()}
    torch.testing.assert_close(module.completion_loss(single).loss, expected)
    both = module.completion_loss(batch).loss  # padded row positions are counted from its first real token
    assert torch.isfinite(both) and both > 0


def test_sft_learns_the_toy_task_and_logs_val_accuracy(student, tokenizer, tmp_path):
    rows = [addition_row(a, 1) for a in range(1, 5)]  # a tiny, memorisable task
    module = SFTModule(
        student,
        tokenizer,
        training={"optimizer": partial(torch.optim.AdamW, lr=3e-3)},
        validation={"metrics": {"accuracy": exact_match}, "max_new_tokens": 6},
    )
    data = ChatDataModule(tokenizer, rows, rows, test_data=rows, batch_size=4, max_length=64)
    held_out = HeldOutEvaluation(max_new_tokens=6)
    trainer = small_trainer(
        tmp_path,
        max_steps=60,
        limit_val_batches=1.0,
        val_check_interval=60,
        check_val_every_n_epoch=None,
        callbacks=[held_out],
    )
    trainer.fit(module, datamodule=data)
    assert trainer.callback_metrics["val/accuracy"] == pytest.approx(held_out.results["after"]["accuracy"])
    assert held_out.results["before"]["accuracy"] == 0.0
    assert held_out.results["after"]["accuracy"] >= 0.25  # 0.5 here: the student memorised 2 of 4 answers
    saved = json.loads((tmp_path / "held_out.json").read_text())
    assert saved["num_rows"] == 4 and saved["after"] == held_out.results["after"]
    assert "teacher" not in saved


def test_held_out_evaluation_scores_the_teacher_once(student, teacher, tokenizer, tmp_path):
    rows = addition_rows("test", 4)
    module = GKDModule(student, teacher, tokenizer, lmbda=0.0, sampling={"max_new_tokens": 4})
    held_out = HeldOutEvaluation(max_new_tokens=4)
    data = ChatDataModule(tokenizer, rows, test_data=rows, batch_size=4)
    trainer = small_trainer(tmp_path, max_steps=1, callbacks=[held_out])
    trainer.fit(module, datamodule=data)
    expected = evaluate_generations(teacher, tokenizer, rows, max_new_tokens=4)
    assert held_out.results["teacher"] == expected
    assert set(held_out.results) == {"teacher", "before", "after", "gap_closed"}
    assert "teacher" in held_out.table(4) and "model after" in held_out.table(4)
