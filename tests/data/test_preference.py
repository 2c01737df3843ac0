"""Preference rows -> [chosen; rejected] batches: formats, validation errors, truncation, DataModule, toy pairs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lightning_gkd import PreferenceDataModule
from lightning_gkd.data.preference import PreferenceCollator
from lightning_gkd.data.preference_validation import validate_preference_rows
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.preference import addition_preference_rows

CONVERSATIONAL = {
    "prompt": [{"role": "user", "content": "2+2="}],
    "chosen": [{"role": "assistant", "content": "4"}],
    "rejected": [{"role": "assistant", "content": "17"}],
}
TEXT = {"prompt": "Q: 2+2=", "chosen": " 4", "rejected": " 17"}


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def real(row_ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return row_ids[mask.bool()].tolist()


def test_conversational_pair_batch_layout(tokenizer):
    other = {
        **CONVERSATIONAL,
        "prompt": [{"role": "user", "content": "100+250="}],
        "chosen": [{"role": "assistant", "content": "350"}],
    }
    batch = PreferenceCollator(tokenizer)([{**CONVERSATIONAL, "row_index": 7}, {**other, "row_index": 3}])
    assert batch["input_ids"].shape[0] == 4 and batch["prompts"].shape[0] == 2
    assert batch["index"].tolist() == [7, 3]
    prompt = ids(tokenizer, "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n")
    chosen = ids(tokenizer, "4<|im_end|>\n")
    rejected = ids(tokenizer, "17<|im_end|>\n")
    # Row 0 is prompt+chosen of pair 0, row 2 prompt+rejected of pair 0; all left-padded to one length.
    assert real(batch["input_ids"][0], batch["attention_mask"][0]) == prompt + chosen
    assert real(batch["input_ids"][2], batch["attention_mask"][2]) == prompt + rejected
    assert batch["labels"][0][batch["labels"][0] != -100].tolist() == chosen
    assert batch["labels"][2][batch["labels"][2] != -100].tolist() == rejected
    assert real(batch["prompts"][0], batch["prompt_attention_mask"][0]) == prompt
    assert (batch["attention_mask"][:, -1] == 1).all()  # left padding: every row ends on a real token
    assert "ref_chosen_logps" not in batch


def test_plain_text_rows_append_eos(tokenizer):
    batch = PreferenceCollator(tokenizer)([TEXT])
    eos = tokenizer.eos_token_id
    assert batch["labels"][0][batch["labels"][0] != -100].tolist() == ids(tokenizer, " 4") + [eos]
    assert batch["labels"][1][batch["labels"][1] != -100].tolist() == ids(tokenizer, " 17") + [eos]
    assert real(batch["prompts"][0], batch["prompt_attention_mask"][0]) == ids(tokenizer, "Q: 2+2=")


def test_pretokenized_rows_pass_untouched(tokenizer):
    row = {
        "prompt_input_ids": [5, 6, 7],
        "chosen_input_ids": [8, 9],
        "rejected_input_ids": [10, 11, 12, 13],
        "ref_chosen_logps": -1.25,
        "ref_rejected_logps": -3.5,
        "prompt": "ignored when ids are given",
    }
    batch = PreferenceCollator(tokenizer)([row])
    assert real(batch["input_ids"][0], batch["attention_mask"][0]) == [5, 6, 7, 8, 9]
    assert real(batch["input_ids"][1], batch["attention_mask"][1]) == [5, 6, 7, 10, 11, 12, 13]
    assert batch["labels"][0].tolist() == [-100] * 2 + [-100, -100, -100, 8, 9]  # padding, prompt, chosen
    assert batch["ref_chosen_logps"].tolist() == [-1.25] and batch["ref_rejected_logps"].tolist() == [-3.5]


ROW = {"prompt_input_ids": list(range(10, 20)), "chosen_input_ids": [1, 2], "rejected_input_ids": [3, 4, 5]}


def test_truncation_keeps_the_first_tokens_by_default_as_trl(tokenizer):
    batch = PreferenceCollator(tokenizer, max_length=12)([ROW])
    assert real(batch["input_ids"][0], batch["attention_mask"][0]) == [*range(10, 20), 1, 2]
    assert real(batch["input_ids"][1], batch["attention_mask"][1]) == [*range(10, 20), 3, 4]  # lost its end
    assert batch["labels"][1][batch["labels"][1] != -100].tolist() == [3, 4]
    message = (
        r"max_length=10 leaves no completion token: the prompt alone has 10 tokens .*TRL drops such rows.*"
        r"max_length=13 keeps this pair whole, 11 at least one completion token.*data.truncation_mode=keep_end"
    )
    with pytest.raises(ValueError, match=message):
        PreferenceCollator(tokenizer, max_length=10)([ROW])


def test_keep_end_keeps_the_last_tokens_only_with_truncate_prompts(tokenizer):
    collate = PreferenceCollator(tokenizer, max_length=6, truncation_mode="keep_end", truncate_prompts=True)
    batch = collate([ROW])
    assert real(batch["input_ids"][0], batch["attention_mask"][0]) == [16, 17, 18, 19, 1, 2]
    assert real(batch["input_ids"][1], batch["attention_mask"][1]) == [17, 18, 19, 3, 4, 5]
    with pytest.raises(ValueError, match=r"max_length=6 cuts the beginning off this row's prompt \(10 prompt \+ 3"):
        PreferenceCollator(tokenizer, max_length=6, truncation_mode="keep_end")([{**ROW, "row_index": 4}])
    with pytest.raises(ValueError, match="max_length=3 truncates away the whole prompt"):
        PreferenceCollator(tokenizer, max_length=3, truncation_mode="keep_end", truncate_prompts=True)([ROW])
    with pytest.raises(ValueError, match=r"truncation_mode must be one of \('keep_start', 'keep_end'\), got 'left'"):
        PreferenceCollator(tokenizer, truncation_mode="left")


LONG_PAIRS = [
    {
        "prompt": [{"role": "user", "content": "What is 12+30? Answer briefly."}],
        "chosen": [{"role": "assistant", "content": "It is 42, the sum."}],
        "rejected": [{"role": "assistant", "content": "17"}],
    },
    {
        "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime."}],
        "chosen": [{"role": "assistant", "content": "Seven is a prime number."}],
        "rejected": [{"role": "assistant", "content": "Nine, I think, or maybe twelve."}],
    },
]
LONG_TEXT = [
    {"prompt": "Q: what is 12+30?", "chosen": " A: 42 exactly", "rejected": " A: 17"},
    {"prompt": "Q: name a prime", "chosen": " 7", "rejected": " nine or twelve"},
]


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("rows, max_length", [(LONG_PAIRS, 64), (LONG_TEXT, 20)])
def test_truncated_token_ids_equal_trls(tokenizer, rows, max_length, mode):
    from helpers.trl_dpo import trl_preference_sequences

    trl = trl_preference_sequences(tokenizer, rows, max_length=max_length, truncation_mode=mode)
    batch = PreferenceCollator(tokenizer, max_length=max_length, truncation_mode=mode, truncate_prompts=True)(rows)
    mask = batch["attention_mask"].bool()
    ours = [row[m].tolist() for row, m in zip(batch["input_ids"], mask, strict=True)]
    completion = [(row[m] != -100).long().tolist() for row, m in zip(batch["labels"], mask, strict=True)]
    assert trl is not None and (ours, completion) == trl
    assert max(len(ids) for ids in ours) == max_length  # the rows did need truncation


def test_keep_start_prompt_filling_max_length_fails_at_setup_where_trl_drops_the_row(tokenizer):
    from helpers.trl_dpo import trl_preference_sequences

    rows = [LONG_TEXT[1], LONG_TEXT[0]]  # prompts of 15 and 17 tokens
    assert trl_preference_sequences(tokenizer, rows[1:], max_length=17, truncation_mode="keep_start") is None
    with pytest.raises(ValueError, match=r"train_data row 1: max_length=17 leaves no completion token.*'Q: what is"):
        PreferenceDataModule(tokenizer, rows, max_length=17).setup()


def test_keep_end_cut_prompts_fail_at_setup_unless_truncate_prompts(tokenizer):
    rows = [*LONG_TEXT, {"prompt": "hi", "chosen": " yes", "rejected": " no"}]
    with pytest.raises(ValueError, match=r"train_data: max_length=20 cuts the beginning off the prompt of 2 of 3"):
        PreferenceDataModule(tokenizer, rows, max_length=20, truncation_mode="keep_end").setup()
    data = PreferenceDataModule(tokenizer, rows, max_length=20, truncation_mode="keep_end", truncate_prompts=True)
    with pytest.warns(UserWarning, match=r"max_length=20 cuts the beginning off the prompt of 2 of 3 checked rows"):
        data.setup()


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Q", "chosen": "A"}, r"row 1: missing field 'rejected' \(fields present: \['chosen', 'prompt'\]\)"),
        ({"prompt": "Q", "chosen": "", "rejected": "B"}, "row 1: 'chosen' is an empty completion"),
        ({**CONVERSATIONAL, "rejected": [{"role": "assistant", "content": ""}]}, "row 1: 'rejected' is an empty compl"),
        ({**CONVERSATIONAL, "chosen": "4"}, "row 1: 'prompt' is a list of messages, so 'chosen' must be one too"),
        ({"prompt": "Q", "chosen": "A", "rejected": ["B"]}, "row 1: 'prompt' is a string, so 'rejected' must be one"),
        ({**CONVERSATIONAL, "chosen": [{"role": "user", "content": "4"}]}, "'chosen' must be exactly one assistant"),
        ({**CONVERSATIONAL, "prompt": [{"role": "robot", "content": "hi"}]}, r"'prompt'\[0\] has unknown role 'robot'"),
        ({"prompt_input_ids": [1], "chosen_input_ids": [], "rejected_input_ids": [2]}, "'chosen_input_ids' is empty"),
        ({**TEXT, "ref_chosen_logps": -1.0}, "has 'ref_chosen_logps' but not its partner"),
        ("not a dict", "row 1: expected a dict, got str"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            r"row 1: missing field 'prompt' \(fields present: \['messages'\]\); the row looks like a chat row "
            r"\('messages'\): DPO needs prompt/chosen/rejected pairs; for chat data use method=gkd or method=sft "
            "with data=chat_files",
        ),
    ],
)
def test_bad_rows_name_the_row_and_field(row, message):
    with pytest.raises(ValueError, match=message):
        validate_preference_rows([TEXT, row], name="train_data")


def test_datamodule_from_jsonl_validates_and_indexes(tokenizer, tmp_path):
    path = tmp_path / "pairs.jsonl"
    other = {**CONVERSATIONAL, "chosen": [{"role": "assistant", "content": "four"}]}
    path.write_text("\n".join(json.dumps(row) for row in [CONVERSATIONAL, other, CONVERSATIONAL]))
    data = PreferenceDataModule(tokenizer, [TEXT] * 3, str(path), batch_size=2, shuffle=False)
    batches = list(data.val_dataloader())
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2]]
    assert [b["input_ids"].shape[0] for b in batches] == [4, 2]

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(row) for row in [TEXT, {**TEXT, "chosen": ""}]))
    with pytest.raises(ValueError, match="val_data row 1: 'chosen' is an empty completion"):
        PreferenceDataModule(tokenizer, [TEXT], str(bad)).setup()


def test_conversational_rows_need_a_chat_template(tokenizer):
    no_template = copy.deepcopy(tokenizer)  # a copy, so the session fixture keeps its template
    no_template.chat_template = None
    PreferenceDataModule(no_template, [TEXT]).setup()  # plain text needs no template
    with pytest.raises(ValueError, match=r"no chat template.*chat_template="):
        PreferenceDataModule(no_template, [CONVERSATIONAL]).setup()


def test_custom_collator_sees_raw_rows_with_their_index(tokenizer):
    seen = []

    def collate(rows):
        seen.extend(rows)
        return {"n": len(rows)}

    data = PreferenceDataModule(
        tokenizer, [{"question": "q1"}, {"question": "q2"}], collator=collate, batch_size=2, shuffle=False
    )
    assert next(iter(data.train_dataloader())) == {"n": 2}  # not validated: the collator owns the format
    assert seen == [{"question": "q1", "row_index": 0}, {"question": "q2", "row_index": 1}]


def test_toy_preference_pairs():
    rows = addition_preference_rows("val", 50)
    assert rows == addition_preference_rows("val", 50)  # deterministic
    for row, source in zip(rows, addition_rows("val", 50), strict=True):
        assert row["prompt"] == source["messages"][:-1] and row["chosen"] == [source["messages"][-1]]
        chosen, rejected, answer = row["chosen"][0]["content"], row["rejected"][0]["content"], row["answer"]
        head, _, tail = chosen.rpartition(answer)  # the rejected reply is the chosen one with a wrong number
        wrong = rejected[len(head) : len(rejected) - len(tail)]
        assert rejected.startswith(head) and rejected.endswith(tail)
        assert wrong.isdigit() and wrong != answer
    assert len({row["rejected"][0]["content"] for row in rows}) > 40  # varied, not one constant wrong answer
    validate_preference_rows(rows)
