import io
import json

import datasets
import pytest
import torch

from lightning_gkd import ChatDataModule
from lightning_gkd.data.chat import ChatMLCollator, tokenize_chat
from lightning_gkd.data.loader import GENERATION_GROUP, GenerationGroup, shuffled_micro_batches
from lightning_gkd.data.sources import load_rows
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.ops.decoding.sampling import completion_batch
from lightning_gkd.toy import addition_rows

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


# --- truncate_prompts: a prompt that loses its beginning is an error unless the user opts in (issue 16 item 5) ---

LONG = {"messages": [{"role": "user", "content": "What is 1+2? " * 3}, {"role": "assistant", "content": "3"}]}


def test_cut_prompts_fail_at_setup_with_the_count_and_the_length_that_fits(tokenizer):
    # ONE_TURN: 23 prompt + 3 completion tokens; LONG: 58 + 3 (its content is 35 characters longer than "1+2=")
    assert len(tokenize_chat(tokenizer, LONG["messages"], 1024).ids) == 61
    data = ChatDataModule(tokenizer, [ONE_TURN, LONG, ONE_TURN, LONG], max_length=30)
    with pytest.raises(ValueError) as caught:
        data.setup("fit")
    assert str(caught.value).startswith(
        "train_data: max_length=30 cuts the beginning off the prompt of 2 of 4 checked rows, so they would train "
        "on prompts without their start. First: row 1, 58 prompt + 3 completion tokens, prompt starts "
        "'What is 1+2? What is 1+2? What is 1+2? '. max_length=61 fits every checked row"
    )
    ChatDataModule(tokenizer, [ONE_TURN, LONG], max_length=61).setup("fit")  # the length it names fits


def test_opting_in_warns_and_truncates_as_before(tokenizer):
    data = ChatDataModule(tokenizer, [ONE_TURN, LONG], max_length=30, truncate_prompts=True, shuffle=False)
    with pytest.warns(UserWarning, match=r"cuts the beginning off the prompt of 1 of 2 checked rows, first row 1"):
        data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    full = tokenize_chat(tokenizer, LONG["messages"], 1024).ids
    assert batch["input_ids"][1].tolist() == full[-30:]
    assert batch["labels"][1].tolist() == [-100] * 27 + full[-3:]


def test_a_row_setup_did_not_check_fails_when_collated_unless_opted_in(tokenizer):
    rows = [ONE_TURN, LONG]
    data = ChatDataModule(tokenizer, rows, max_length=30, length_check_rows=1, batch_size=2, shuffle=False)
    data.setup("fit")  # row 0 only was checked
    with pytest.raises(
        ValueError,
        match=r"^train_data row 1: max_length=30 cuts the beginning off this row's prompt "
        r"\(58 prompt \+ 3 completion tokens; max_length=61 fits it\)",
    ):
        next(iter(data.train_dataloader()))
    opted_in = ChatDataModule(
        tokenizer, rows, max_length=30, length_check_rows=1, batch_size=2, truncate_prompts=True, shuffle=False
    )
    opted_in.setup("fit")
    assert next(iter(opted_in.train_dataloader()))["input_ids"].shape == (2, 30)


def test_test_rows_are_not_length_checked_and_the_bare_collator_still_truncates(tokenizer):
    data = ChatDataModule(tokenizer, [ONE_TURN], test_data=[LONG], max_length=30)
    data.setup("fit")
    assert data.test_rows == [LONG]  # the evaluator generates from them with its own max_length
    assert ChatMLCollator(tokenizer, max_length=30)([LONG])["input_ids"].shape == (1, 30)


@pytest.mark.parametrize("data_config", ["toy", "toy_chain"])
def test_the_shipped_toy_data_keeps_every_prompt_whole(tmp_path, tokenizer, data_config):
    from helpers.hydra_compose import compose_train
    from hydra.utils import instantiate

    cfg = compose_train(tmp_path, [f"data={data_config}"])
    assert cfg.data.truncate_prompts is False
    data = instantiate(cfg.data, tokenizer=tokenizer, _convert_="all")
    data.setup("fit")  # the 1000-row samples of train and val: an error if any prompt were cut
    lengths = [len(tokenize_chat(tokenizer, data.train_rows[i]["messages"], 1024).ids) for i in range(0, 2000, 7)]
    assert max(lengths) <= cfg.data.max_length


# --- assistant_turns="all": every assistant turn is trained on (issue 16 item 15) ---

THREE_TURNS = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "1+2"},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "2+5"},
    {"role": "assistant", "content": "7, so"},
    {"role": "user", "content": "and 4+4?"},
    {"role": "assistant", "content": "8"},
]


def labelled_spans(tokenizer, labels: list[int]) -> list[str]:
    """The decoded runs of labelled tokens."""
    spans, run = [], []
    for label in [*labels, -100]:
        if label != -100:
            run.append(label)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def test_all_turns_label_each_assistant_content_and_its_end_of_turn(tokenizer):
    batch = ChatMLCollator(tokenizer, assistant_turns="all")([{"messages": THREE_TURNS}])
    labels = batch["labels"][0].tolist()
    assert labelled_spans(tokenizer, labels) == ["3<|im_end|>\n", "7, so<|im_end|>\n", "8<|im_end|>\n"]
    ids = batch["input_ids"][0].tolist()
    assert all(label in (-100, token) for label, token in zip(labels, ids, strict=True))
    # the prompt on-policy sampling continues is still the one before the LAST assistant turn
    last = ChatMLCollator(tokenizer)([{"messages": THREE_TURNS}])
    assert torch.equal(batch["prompts"], last["prompts"]) and torch.equal(batch["input_ids"], last["input_ids"])
    assert labelled_spans(tokenizer, last["labels"][0].tolist()) == ["8<|im_end|>\n"]


def test_all_turns_exact_ids_and_last_is_unchanged(tokenizer):
    everything = ChatMLCollator(tokenizer, assistant_turns="all")([MULTI_TURN, ONE_TURN])
    start_yo = len(turn(SYSTEM, [36, 71])) + len(turn(USER, [74, 75])) + 1 + len(ASSISTANT) + 1
    expected = [-100] * len(MULTI_PROMPT) + MULTI_COMPLETION
    expected[start_yo : start_yo + 4] = [91, 81, 2, NL]  # "yo<|im_end|>\n"
    assert everything["labels"][0].tolist() == expected
    assert ChatMLCollator(tokenizer, assistant_turns="last")([MULTI_TURN])["labels"][0].tolist() == (
        [-100] * len(MULTI_PROMPT) + MULTI_COMPLETION
    )
    # a single-turn row is the same either way
    assert everything["labels"][1].tolist() == ChatMLCollator(tokenizer)([MULTI_TURN, ONE_TURN])["labels"][1].tolist()


def test_all_turns_sft_loss_is_the_mean_over_every_assistant_token(tokenizer, student):
    from lightning_gkd import SFTModule

    batch = ChatMLCollator(tokenizer, assistant_turns="all")([{"messages": THREE_TURNS}])
    loss = SFTModule(student, tokenizer).completion_loss(batch).loss
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    with torch.no_grad():
        log_probs = torch.log_softmax(student(ids[None]).logits[0].float(), dim=-1)
    positions = [t for t in range(1, len(ids)) if labels[t] != -100]
    assert len(positions) == 1 + 5 + 1 + 3 * 2  # contents "3", "7, so", "8" + <|im_end|> "\n" each
    by_hand = -sum(log_probs[t - 1, ids[t]] for t in positions) / len(positions)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_all_turns_truncation_cuts_earlier_turns_with_the_prompt(tokenizer):
    full = ChatMLCollator(tokenizer, assistant_turns="all")([{"messages": THREE_TURNS}])["labels"][0].tolist()
    first_label = next(i for i, label in enumerate(full) if label != -100)
    keep = len(full) - first_label - 2  # cut the first assistant turn's "3<|im_end|>" off, keep its "\n"
    cut = ChatMLCollator(tokenizer, max_length=keep, assistant_turns="all")([{"messages": THREE_TURNS}])
    assert cut["labels"][0].tolist() == full[-keep:]
    assert labelled_spans(tokenizer, cut["labels"][0].tolist()) == ["\n", "7, so<|im_end|>\n", "8<|im_end|>\n"]


def test_the_datamodule_trains_on_all_turns_and_validates_on_the_last(tokenizer):
    data = ChatDataModule(
        tokenizer, [{"messages": THREE_TURNS}], val_data=[{"messages": THREE_TURNS}], assistant_turns="all"
    )
    train = next(iter(data.train_dataloader()))
    assert len(labelled_spans(tokenizer, train["labels"][0].tolist())) == 3
    val = next(iter(data.val_dataloader()))
    assert labelled_spans(tokenizer, val["labels"][0].tolist()) == ["8<|im_end|>\n"]
    with pytest.raises(ValueError, match=r"assistant_turns must be 'last' .* or 'all' .*, got 'every'"):
        ChatDataModule(tokenizer, [ONE_TURN], assistant_turns="every")


def test_all_turns_needs_a_template_that_renders_prefixes_as_the_start_of_the_whole(tokenizer):
    from lightning_gkd.data.tokenizer import CHATML_TEMPLATE

    tok = build_chatml_tokenizer()
    # like templates that drop the reasoning of earlier turns: the final assistant message renders differently
    tok.chat_template = CHATML_TEMPLATE.replace(
        "message['content'] +", "message['content'] + ('!' if loop.last and message['role'] == 'assistant' else '') +"
    )
    with pytest.raises(ValueError, match=r"up to assistant message 2 differently .* Use assistant_turns='last'"):
        tokenize_chat(tok, THREE_TURNS, 1024, assistant_turns="all")
    assert tokenize_chat(tok, THREE_TURNS, 1024).ids  # the last turn alone is still found


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_all_turns_matches_trl_assistant_only_loss(tokenizer, student, tmp_path):
    """TRL's SFTTrainer(assistant_only_loss=True) as the oracle: it needs {% generation %} markers, so it gets the
    same ChatML with markers around each assistant turn's content and end-of-turn tokens (the same rendered text)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from lightning_gkd.data.tokenizer import build_chatml_tokenizer

    marked = build_chatml_tokenizer()
    marked.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}"
        "{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    rows = [{"messages": THREE_TURNS}, MULTI_TURN]
    assert [marked.apply_chat_template(r["messages"], tokenize=False) for r in rows] == [
        tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows
    ]
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to=[], max_length=None, use_cpu=True)
    trl = SFTTrainer(
        model=student, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=marked
    ).train_dataset
    for index, row in enumerate(rows):
        ours = ChatMLCollator(tokenizer, assistant_turns="all")([row])
        assert ours["input_ids"][0].tolist() == trl[index]["input_ids"]
        assert ours["labels"][0].tolist() == trl[index]["labels"]


def test_a_chat_template_can_be_a_jinja_file(tmp_path, toy_rows):
    from lightning_gkd.data.tokenizer import CHATML_TEMPLATE

    bare = build_chatml_tokenizer()
    bare.chat_template = None
    (tmp_path / "chatml.jinja").write_text(CHATML_TEMPLATE)
    data = ChatDataModule(bare, toy_rows["train"], chat_template=str(tmp_path / "chatml.jinja"))
    assert data.tokenizer.chat_template == CHATML_TEMPLATE
    with pytest.raises(FileNotFoundError, match=r"chat_template file '.*missing.jinja' does not exist"):
        ChatDataModule(build_chatml_tokenizer(), toy_rows["train"], chat_template=str(tmp_path / "missing.jinja"))


# --- prompt messages carried for a teacher with its own chat template (issue 17) ---


def _assert_prompt_messages_render_the_prompts(tokenizer, batch):
    assert len(batch["prompt_messages"]) == batch["prompts"].shape[0]
    for messages, prompt, mask in zip(
        batch["prompt_messages"], batch["prompts"], batch["prompt_attention_mask"], strict=True
    ):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == prompt[mask.bool()].tolist()


def test_prompt_messages_are_carried_when_asked(tokenizer):
    prompt_only = {"messages": [{"role": "user", "content": "q"}]}
    rows = [ONE_TURN, MULTI_TURN, prompt_only]
    assert "prompt_messages" not in ChatMLCollator(tokenizer, 256)(rows)
    batch = ChatMLCollator(tokenizer, 256, carry_prompt_messages=True)(rows)
    assert batch["prompt_messages"] == [ONE_TURN["messages"][:1], MULTI_TURN["messages"][:4], prompt_only["messages"]]
    _assert_prompt_messages_render_the_prompts(tokenizer, batch)


def test_grouped_and_sampled_micro_batches_keep_prompt_messages_with_their_rows(tokenizer):
    """Grouped generation cuts a group (and its samples, shuffled) into micro-batches with select_rows: each row's
    prompt messages stay with its row, and a checkpointed group plan keeps them (weights-only loadable)."""
    rows = addition_rows("train", 12)
    dm = ChatDataModule(tokenizer, rows, {"a": rows[:3]}, batch_size=2, steps_per_generation=3, max_length=64, seed=5)
    dm.carry_prompt_messages()
    items = list(dm.train_dataloader())
    assert len(items) == 6
    for item in items:
        _assert_prompt_messages_render_the_prompts(tokenizer, item)
        group = item[GENERATION_GROUP]
        completions = torch.randint(3, 259, (group["prompts"].shape[0], 4), generator=torch.Generator().manual_seed(0))
        sampled = {**group, **completion_batch(group["prompts"], group["prompt_attention_mask"], completions, 2)}
        micro_batches = shuffled_micro_batches(sampled, 2, seed=7)
        for micro in micro_batches:
            _assert_prompt_messages_render_the_prompts(tokenizer, micro)
    buffer = io.BytesIO()
    torch.save(GenerationGroup([0, 0], "student", micro_batches).state(), buffer)
    buffer.seek(0)
    restored = GenerationGroup(**torch.load(buffer, weights_only=True))
    assert [m["prompt_messages"] for m in restored.micro_batches] == [m["prompt_messages"] for m in micro_batches]
    (val_loader,) = dm.val_dataloader()
    _assert_prompt_messages_render_the_prompts(tokenizer, next(iter(val_loader)))
