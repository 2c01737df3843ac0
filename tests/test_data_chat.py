import json

import datasets
import pytest
import torch

from lightning_gkd import ChatDataModule
from lightning_gkd.data.chat import ChatMLCollator, tokenize_chat
from lightning_gkd.data.sources import load_rows
from lightning_gkd.data.tokenizer import build_chatml_tokenizer

# Hand-checked ids of the project tokenizer: 0 pad, 1 <|im_start|>, 2 <|im_end|>, "\n" = 201, " " = 223,
# and printable ASCII character c = ord(c) - 30 (the 256 byte symbols follow the 3 specials in sorted order).
NL = 201
USER = [87, 85, 71, 84]  # "user"
ASSISTANT = [67, 85, 85, 75, 85, 86, 67, 80, 86]  # "assistant"
SYSTEM = [85, 91, 85, 86, 71, 79]  # "system"


def turn(role_ids, content_ids):
    return [1, *role_ids, NL, *content_ids, 2, NL]


ONE_TURN = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}
ONE_TURN_PROMPT = [*turn(USER, [19, 13, 20, 31]), 1, *ASSISTANT, NL]  # ... "<|im_start|>assistant\n"
ONE_TURN_COMPLETION = [21, 2, NL]  # "3<|im_end|>\n"

MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "Be"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "k"},
    ]
}
MULTI_PROMPT = [
    *turn(SYSTEM, [36, 71]),
    *turn(USER, [74, 75]),
    *turn(ASSISTANT, [91, 81]),
    *turn(USER, [81, 77]),
    1,
    *ASSISTANT,
    NL,
]
MULTI_COMPLETION = [77, 2, NL]  # only the LAST assistant turn is the completion


def test_character_ids_match_the_hand_table(tokenizer):
    assert tokenizer("1+2=3 yo", add_special_tokens=False)["input_ids"] == [19, 13, 20, 31, 21, 223, 91, 81]


def test_single_turn_exact_ids(tokenizer):
    chat = tokenize_chat(tokenizer, ONE_TURN["messages"], max_length=1024)
    assert chat.ids == ONE_TURN_PROMPT + ONE_TURN_COMPLETION
    assert chat.num_prompt_tokens == len(ONE_TURN_PROMPT) == 23


def test_multi_turn_exact_ids(tokenizer):
    chat = tokenize_chat(tokenizer, MULTI_TURN["messages"], max_length=1024)
    assert chat.ids == MULTI_PROMPT + MULTI_COMPLETION
    assert chat.num_prompt_tokens == len(MULTI_PROMPT)


def test_collated_batch_is_left_padded_with_prompt_masked(tokenizer):
    batch = ChatMLCollator(tokenizer)([ONE_TURN, MULTI_TURN])
    assert set(batch) == {"input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask"}
    width = len(MULTI_PROMPT) + 3
    pad = width - 26
    assert batch["input_ids"].tolist() == [
        [0] * pad + ONE_TURN_PROMPT + ONE_TURN_COMPLETION,
        MULTI_PROMPT + MULTI_COMPLETION,
    ]
    assert batch["attention_mask"].tolist() == [[0] * pad + [1] * 26, [1] * width]
    assert batch["labels"].tolist() == [
        [-100] * (pad + 23) + ONE_TURN_COMPLETION,
        [-100] * len(MULTI_PROMPT) + MULTI_COMPLETION,
    ]
    prompt_pad = len(MULTI_PROMPT) - 23
    assert batch["prompts"].tolist() == [[0] * prompt_pad + ONE_TURN_PROMPT, MULTI_PROMPT]
    assert batch["prompt_attention_mask"].tolist() == [[0] * prompt_pad + [1] * 23, [1] * len(MULTI_PROMPT)]
    assert all(t.dtype == torch.long for t in batch.values())


def test_prompt_only_row_has_no_labels(tokenizer):
    row = {"messages": [{"role": "user", "content": "1+2="}]}
    batch = ChatMLCollator(tokenizer)([row])
    assert batch["input_ids"].tolist() == [ONE_TURN_PROMPT] == batch["prompts"].tolist()
    assert (batch["labels"] == -100).all()


def test_truncation_keeps_the_last_tokens(tokenizer):
    chat = tokenize_chat(tokenizer, ONE_TURN["messages"], max_length=5)
    assert chat.ids == (ONE_TURN_PROMPT + ONE_TURN_COMPLETION)[-5:]
    assert chat.num_prompt_tokens == 2
    with pytest.raises(ValueError, match=r"max_length=3 truncates away the whole prompt.*3 tokens"):
        tokenize_chat(tokenizer, ONE_TURN["messages"], max_length=3)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "hi"}, r"train_data row 1: missing field 'messages' \(fields present: \['text'\]\)"),
        ({"messages": [{"content": "hi"}]}, r"row 1: messages\[0\] is missing 'role'"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, r"row 1: messages\[0\] has unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": 7}]}, r"row 1: messages\[0\] has non-string content of type int"),
        ({"messages": [{"role": "user"}]}, r"row 1: messages\[0\] is missing 'content'"),
        ({"messages": []}, r"row 1: 'messages' must be a non-empty list"),
    ],
)
def test_bad_rows_are_named(tokenizer, row, message):
    dm = ChatDataModule(tokenizer, [ONE_TURN, row])
    with pytest.raises(ValueError, match=message):
        dm.setup("fit")


def test_empty_dataset_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="train_data is empty"):
        ChatDataModule(tokenizer, []).setup("fit")
    with pytest.raises(ValueError, match="val_data is empty"):
        ChatDataModule(tokenizer, [ONE_TURN], val_data=datasets.Dataset.from_list([])).setup("fit")


def test_tokenizer_without_chat_template_names_the_option():
    tok = build_chatml_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*data\.chat_template"):
        ChatDataModule(tok, [ONE_TURN])
    from lightning_gkd.data.tokenizer import CHATML_TEMPLATE

    assert ChatDataModule(tok, [ONE_TURN], chat_template=CHATML_TEMPLATE).tokenizer.chat_template == CHATML_TEMPLATE


def test_tokenizer_without_pad_falls_back_to_eos_with_a_warning():
    tok = build_chatml_tokenizer()
    tok.pad_token = None
    with pytest.warns(UserWarning, match="no pad token; padding with EOS"):
        dm = ChatDataModule(tok, [ONE_TURN])
    assert dm.tokenizer.pad_token_id == dm.tokenizer.eos_token_id == 2


def _write_sources(tmp_path, rows):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    hub_like = tmp_path / "hub_like"  # a dataset repository checked out locally: the path a hub id takes
    (hub_like / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(hub_like / "data" / "train-00000.parquet"))


def test_every_source_kind_gives_the_same_batches(tokenizer, tmp_path):
    rows = [ONE_TURN, MULTI_TURN, {"messages": [{"role": "user", "content": "only a prompt"}]}]
    _write_sources(tmp_path, rows)
    sources = [
        rows,
        datasets.Dataset.from_list(rows),
        datasets.DatasetDict(train=datasets.Dataset.from_list(rows)),
        tmp_path / "rows.jsonl",
        str(tmp_path / "rows.json"),
        str(tmp_path / "rows.parquet"),
        str(tmp_path / "saved"),
        str(tmp_path / "hub_like"),
    ]
    expected = ChatMLCollator(tokenizer)(rows)
    for source in sources:
        dm = ChatDataModule(tokenizer, source, batch_size=3, shuffle=False)
        batch = next(iter(dm.train_dataloader()))
        for key, value in expected.items():
            assert torch.equal(batch[key], value), (source, key)


def test_missing_file_and_unknown_split(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match=r"no split 'test' \(it has \['train'\]\)"):
        load_rows(datasets.DatasetDict(train=datasets.Dataset.from_list([ONE_TURN])), split="test")


def test_dataloaders_shuffle_reproducibly_and_validate(tokenizer, toy_rows):
    dm = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=8, val_batch_size=16, seed=3)
    first = [b["input_ids"] for b in dm.train_dataloader()]
    again = [
        b["input_ids"] for b in ChatDataModule(tokenizer, toy_rows["train"], batch_size=8, seed=3).train_dataloader()
    ]
    assert len(first) == 8 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    val = list(dm.val_dataloader())
    assert len(val) == 1 and val[0]["input_ids"].shape[0] == 16
    assert ChatDataModule(tokenizer, toy_rows["train"]).val_dataloader() == []
