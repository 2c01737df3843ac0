"""formatting_func: raw rows -> chat rows, lazily per row, from Python and from the Hydra config."""

import json
from functools import partial

import pytest
import torch
from helpers.formatting import CALLS, qa_to_chat
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from lightning_gkd import ChatDataModule
from lightning_gkd.data.formatting import FormattedRows


def as_qa(rows):
    return [{"question": r["messages"][0]["content"], "answer": r["messages"][-1]["content"]} for r in rows]


def same_batches(left: ChatDataModule, right: ChatDataModule) -> None:
    first, second = next(iter(left.train_dataloader())), next(iter(right.train_dataloader()))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_python_formatting_func_gives_the_same_batches_as_messages(tokenizer, toy_rows):
    chat = toy_rows["train"][:8]
    assert [m["role"] for m in chat[0]["messages"]] == ["user", "assistant"]
    raw = as_qa(chat)
    formatted = ChatDataModule(
        tokenizer,
        raw,
        val_data=as_qa(toy_rows["val"][:4]),
        formatting_func=qa_to_chat,
        batch_size=8,
        shuffle=False,
        max_length=64,
    )
    plain = ChatDataModule(tokenizer, chat, batch_size=8, shuffle=False, max_length=64)
    formatted.setup("fit")
    plain.setup("fit")
    same_batches(formatted, plain)
    assert formatted.val_rows[0]["messages"] == toy_rows["val"][0]["messages"]


def test_it_is_applied_lazily_without_copying(tokenizer, toy_rows):
    raw = as_qa(toy_rows["train"][:8])
    data = ChatDataModule(tokenizer, raw, formatting_func=qa_to_chat, length_check_rows=2, max_length=64)
    CALLS.clear()
    data.setup("fit")
    assert isinstance(data.train_rows, FormattedRows) and data.train_rows.rows == raw
    assert raw[0] == as_qa(toy_rows["train"][:1])[0]  # the raw rows are left as they were
    called = len(CALLS)
    data.train_rows[3]
    assert len(CALLS) == called + 1  # formatted when read, not stored


def test_returned_shapes_and_errors(tokenizer):
    rows = [{"q": "hi"}]
    ok = ChatDataModule(tokenizer, rows, formatting_func=lambda r: [{"role": "user", "content": r["q"]}])
    ok.setup("fit")
    assert ok.train_rows[0] == {"messages": [{"role": "user", "content": "hi"}]}
    bad = ChatDataModule(tokenizer, rows, formatting_func=lambda r: "hi")
    with pytest.raises(TypeError, match="train_data row 0: formatting_func returned str"):
        bad.setup("fit")
    keys = ChatDataModule(tokenizer, rows, formatting_func=lambda r: {"text": "hi"})
    with pytest.raises(ValueError, match=r"returned a dict with keys \['text'\]; it needs 'messages'"):
        keys.setup("fit")
    with pytest.raises(ValueError, match="formatting_func='no_such_module.fn' cannot be imported"):
        ChatDataModule(tokenizer, rows, formatting_func="no_such_module.fn")


def compose_data(tmp_path, toy_rows, override: str):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in as_qa(toy_rows["train"][:8])))
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "data=chat_files",
                f"data.train_data={path}",
                "+data.shuffle=false",
                "data.max_length=64",
                override,
            ],
        )
    return cfg


@pytest.mark.parametrize(
    "override",
    [
        "data.formatting_func=helpers.formatting.qa_to_chat",
        "data.formatting_func={_target_:helpers.formatting.qa_to_chat,_partial_:true,system:brief}",
    ],
)
def test_formatting_func_from_the_config(tmp_path, tokenizer, toy_rows, override):
    cfg = compose_data(tmp_path, toy_rows, override)
    data = instantiate(cfg.data, tokenizer=tokenizer, _convert_="all")
    data.setup("fit")
    first = data.train_rows[0]["messages"]
    expected = toy_rows["train"][0]["messages"]
    if "system" in override:
        assert isinstance(data.formatting_func, partial)
        assert first == [{"role": "system", "content": "brief"}, *expected]
    else:
        assert first == expected
        plain = ChatDataModule(tokenizer, toy_rows["train"][:8], shuffle=False, max_length=64)
        plain.setup("fit")
        same_batches(data, plain)


# --- native rows without a formatting_func, as TRL's SFT/GKD data takes them (issue 16 item 9) ---

PROMPT_COMPLETION = [
    {"prompt": "1+2=", "completion": "3"},
    {"prompt": [{"role": "system", "content": "Be"}, {"role": "user", "content": "hi"}], "completion": "yo"},
    {
        "prompt": [{"role": "user", "content": "ok"}],
        "completion": [{"role": "assistant", "content": "k"}],
        "teacher": "a",
    },
    {"prompt": "only a prompt"},
]
AS_MESSAGES = [
    {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]},
    {
        "messages": [
            {"role": "system", "content": "Be"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    },
    {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "k"}], "teacher": "a"},
    {"messages": [{"role": "user", "content": "only a prompt"}]},
]


def test_prompt_completion_rows_are_read_as_chat_rows(tokenizer, tmp_path):
    native = ChatDataModule(tokenizer, PROMPT_COMPLETION, batch_size=4, shuffle=False)
    native.setup("fit")
    assert isinstance(native.train_rows, FormattedRows)  # converted lazily, as read
    assert [dict(row) for row in native.train_rows] == AS_MESSAGES  # other columns ("teacher") are kept
    same_batches(native, ChatDataModule(tokenizer, AS_MESSAGES, batch_size=4, shuffle=False))
    # a file of text prompt/completion rows, one prompt-only (its completion column is null there)
    path = tmp_path / "pc.jsonl"
    path.write_text("\n".join(json.dumps(PROMPT_COMPLETION[i]) for i in (0, 3)))
    from_file = ChatDataModule(tokenizer, str(path), batch_size=2, shuffle=False)
    from_file.setup("fit")
    assert [row["messages"] for row in from_file.train_rows] == [AS_MESSAGES[i]["messages"] for i in (0, 3)]


def test_rows_with_messages_are_left_as_they_are(tokenizer, toy_rows):
    data = ChatDataModule(tokenizer, toy_rows["train"][:4])
    data.setup("fit")
    assert data.train_rows == toy_rows["train"][:4]


def test_mixed_rows_in_an_arrow_file_read_null_fields_as_absent(tokenizer, tmp_path):
    import datasets

    # one column per field, null where a row has none: what a parquet/arrow file of mixed rows holds
    messages = AS_MESSAGES[0]["messages"]
    table = {"messages": [messages, None, None], "prompt": [None, "1+2=", None], "completion": [None, "3", None]}
    table["text"] = [None, None, "hello"]
    datasets.Dataset.from_dict(table).to_parquet(str(tmp_path / "mixed.parquet"))
    data = ChatDataModule(tokenizer, str(tmp_path / "mixed.parquet"))
    with pytest.raises(
        ValueError, match=r"^train_data row 2: missing field 'messages' \(fields present: \['text'\]\)\. Each row needs"
    ):
        data.setup("fit")
    good = datasets.Dataset.from_dict({key: value[:2] for key, value in table.items()})
    data = ChatDataModule(tokenizer, good)
    data.setup("fit")
    assert data.train_rows[0]["messages"] == data.train_rows[1]["messages"] == messages


def test_preference_rows_point_to_dpo(tokenizer):
    pair = {"prompt": "Q: 2+2=", "chosen": " 4", "rejected": " 17"}
    for rows in ([pair], [{"prompt_input_ids": [5], "chosen_input_ids": [6], "rejected_input_ids": [7]}]):
        with pytest.raises(
            ValueError,
            match=r"^train_data row 0 has 'chosen' and 'rejected' fields: these look like preference rows, .* "
            r"`method=dpo data=preference_files` \(Python: PreferenceDataModule with DPOModule\)",
        ):
            ChatDataModule(tokenizer, rows).setup("fit")


def test_a_prompt_of_another_type_is_named(tokenizer):
    with pytest.raises(ValueError, match=r"^train_data row 0: 'prompt' must be a string or a list of .*, got int\.$"):
        ChatDataModule(tokenizer, [{"prompt": 7, "completion": "x"}]).setup("fit")
