"""Chat rows with images -> batches (lightning_gkd.data.vision_chat) for every tiny VLM family, and ChatDataModule with
a processor: ids and labels against hand-built expectations, left padding, image inputs per row, prompts that never
lose an image token, and the checks setup runs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.vlm import (
    COMPLETION,
    IMAGE_TOKEN_COUNTS,
    PAD,
    assert_same_vision,
    hand_completion,
    hand_prompt,
    image_row,
    picture,
    processor_prompt,
    text_ids,
)

from lightning_gkd import ChatDataModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.loader import GENERATION_GROUP, shuffled_micro_batches
from lightning_gkd.data.rows import ROW_INDEX
from lightning_gkd.data.vision_chat import VisionChatCollator, check_vision_options, tokenize_vision_chat
from lightning_gkd.ops.decoding.sampling import completion_batch
from lightning_gkd.ops.hf.model_inputs import image_token_id
from lightning_gkd.toy.tiny_vlm import VLM_FAMILIES, tiny_vlm

_BUILT: dict[str, tuple] = {}


def vlm(family: str):
    """``tiny_vlm(family)``, built once per module."""
    if family not in _BUILT:
        _BUILT[family] = tiny_vlm(family, seed=0)
    return _BUILT[family]


def processor_of(family: str):
    return vlm(family)[1]


def image_tokens_of(family: str) -> int:
    return image_token_id(vlm(family)[0])


def pad_left(ids: list[int], width: int, value: int) -> list[int]:
    return [value] * (width - len(ids)) + ids


def vision_of(processor, row, images) -> dict[str, torch.Tensor]:
    """The image inputs the collator should carry for a row: the processor's outputs for its prompt and images,
    less the text batch and the per-token outputs."""
    encoded = processor_prompt(processor, row, images)
    length = encoded["input_ids"].shape[1]
    return {
        key: value
        for key, value in encoded.items()
        if key not in ("input_ids", "attention_mask") and not (value.dim() >= 2 and value.shape[:2] == (1, length))
    }


# ---- one family at a time: ids, labels, padding ----------------------------------------------------------------------


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_one_row_matches_hand_built_ids_and_the_processor(family):
    processor = processor_of(family)
    image = picture(0)
    row = image_row(image, "What shape?")
    prompt = hand_prompt(family, processor.tokenizer, [image, "What shape?"])
    completion = hand_completion()
    assert completion == processor.tokenizer(f"{COMPLETION}<|im_end|>\n", add_special_tokens=False)["input_ids"]
    encoded = processor_prompt(processor, row, [image])
    assert encoded["input_ids"][0].tolist() == prompt  # the hand-built ids are the processor's

    batch = VisionChatCollator(processor, 256)([row])
    assert set(batch) == {"input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask", "vision"}
    assert batch["input_ids"].tolist() == [prompt + completion]
    assert batch["attention_mask"].tolist() == [[1] * len(prompt + completion)]
    assert batch["labels"].tolist() == [[-100] * len(prompt) + completion]
    assert batch["prompts"].tolist() == [prompt]
    assert batch["prompt_attention_mask"].tolist() == [[1] * len(prompt)]
    assert_same_vision(batch["vision"], [vision_of(processor, row, [image])])
    assert "pixel_values" in batch["vision"][0]
    assert not any(key in batch["vision"][0] for key in ("token_type_ids", "mm_token_type_ids", "cross_attention_mask"))


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_image_tokens_per_image(family):
    processor = processor_of(family)
    token = image_tokens_of(family)
    chat = tokenize_vision_chat(processor, image_row(picture(0), "What shape?"), 256)
    assert chat.prompt_ids.count(token) == IMAGE_TOKEN_COUNTS[family]
    assert token not in chat.completion_ids
    # the image token stands only where the image is: the text around it is the text alone
    text_only = tokenize_vision_chat(processor, image_row("What shape?"), 256)
    expansion = len(hand_prompt(family, processor.tokenizer, [picture(0)])) - len(
        hand_prompt(family, processor.tokenizer, [])
    )
    assert len(chat.prompt_ids) == len(text_only.prompt_ids) + expansion
    assert text_only.prompt_ids.count(token) == 0 and text_only.images == {}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_uneven_rows_are_left_padded(family):
    processor = processor_of(family)
    first, second = picture(1), picture(2, size=(30, 50))
    rows = [
        image_row(first, "What shape?"),
        image_row("Hi, what is in this picture?", second, completion="a blue circle on grey"),
    ]
    prompts = [
        hand_prompt(family, processor.tokenizer, [first, "What shape?"]),
        hand_prompt(family, processor.tokenizer, ["Hi, what is in this picture?", second]),
    ]
    completions = [hand_completion(), hand_completion("a blue circle on grey")]
    full = [p + c for p, c in zip(prompts, completions, strict=True)]
    width, prompt_width = max(map(len, full)), max(map(len, prompts))
    assert len(full[0]) < width and len(prompts[0]) < prompt_width  # the first row is padded in both

    batch = VisionChatCollator(processor, 256)(rows)
    assert batch["input_ids"].tolist() == [pad_left(ids, width, PAD) for ids in full]
    assert batch["attention_mask"].tolist() == [pad_left([1] * len(ids), width, 0) for ids in full]
    assert batch["labels"].tolist() == [
        pad_left([-100] * len(p) + c, width, -100) for p, c in zip(prompts, completions, strict=True)
    ]
    assert batch["prompts"].tolist() == [pad_left(p, prompt_width, PAD) for p in prompts]
    assert batch["prompt_attention_mask"].tolist() == [pad_left([1] * len(p), prompt_width, 0) for p in prompts]
    assert_same_vision(
        batch["vision"], [vision_of(processor, rows[0], [first]), vision_of(processor, rows[1], [second])]
    )
    # each row's images are its own: the two pictures differ, so their pixels do
    assert not torch.equal(batch["vision"][0]["pixel_values"], batch["vision"][1]["pixel_values"])


def test_llava_two_images_in_a_row_and_a_text_only_row():
    processor = processor_of("llava")
    token = image_tokens_of("llava")
    a, b, c = picture(3), picture(4, size=(50, 30)), picture(5)
    text_row = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    rows = [image_row(a, "Compare", b, "please.", completion="same"), text_row, image_row(c, "?")]
    batch = VisionChatCollator(processor, 256)(rows)

    counts = [(batch["prompts"][i][batch["prompt_attention_mask"][i].bool()] == token).sum().item() for i in range(3)]
    assert counts == [8, 0, 4]
    first = hand_prompt("llava", processor.tokenizer, [a, "Compare", b, "please."])
    real = batch["prompt_attention_mask"][0].bool()
    assert batch["prompts"][0][real].tolist() == first
    # the two images in the order their parts appear, each as the processor gives it alone
    pixels = batch["vision"][0]["pixel_values"]
    assert pixels.shape == (2, 3, 28, 28)
    assert torch.equal(pixels[0], vision_of(processor, image_row(a), [a])["pixel_values"][0])
    assert torch.equal(pixels[1], vision_of(processor, image_row(b), [b])["pixel_values"][0])
    # the text-only row has no image inputs and the ids a text collator gives it
    assert batch["vision"][1] == {}
    text = ChatMLCollator(processor.tokenizer, 256)([text_row])
    for key in ("input_ids", "labels", "prompts"):
        mask = batch["attention_mask" if key != "prompts" else "prompt_attention_mask"][1].bool()
        assert batch[key][1][mask].tolist() == text[key][0].tolist()
    assert_same_vision(batch["vision"][2:], [vision_of(processor, rows[2], [c])])


def test_images_column_and_parts_give_the_same_batch():
    processor = processor_of("llava")
    a, b = picture(6), picture(7)
    in_parts = image_row(a, "and", b)
    in_column = image_row({"type": "image"}, "and", {"type": "image"}, images=[a, b])
    collate = VisionChatCollator(processor, 256)
    one, two = collate([in_parts]), collate([in_column])
    for key in ("input_ids", "labels", "prompts"):
        assert torch.equal(one[key], two[key])
    assert_same_vision(one["vision"], two["vision"])


# ---- max_length: prompts are never cut -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_prompt_longer_than_max_length_is_refused_naming_the_row(family):
    processor = processor_of(family)
    image = picture(0)
    row = {**image_row(image, "What shape?"), ROW_INDEX: 7}
    prompt = hand_prompt(family, processor.tokenizer, [image, "What shape?"])
    collate = VisionChatCollator(processor, len(prompt) - 1, name="train_data")
    with pytest.raises(ValueError) as caught:
        collate([image_row(picture(1), "ok"), row])
    assert str(caught.value).startswith(
        f"train_data row 7: its prompt is {len(prompt)} tokens (image tokens included) but max_length is "
        f"{len(prompt) - 1}; an image's tokens are never cut"
    )
    with pytest.raises(ValueError, match=rf"^data: its prompt is {len(prompt)} tokens"):  # no index: the name alone
        VisionChatCollator(processor, len(prompt) - 1)([image_row(image, "What shape?")])
    # a prompt that fits exactly is kept whole; its completion has no room left
    batch = VisionChatCollator(processor, len(prompt))([row])
    assert batch["input_ids"].tolist() == [prompt]
    assert batch["labels"].tolist() == [[-100] * len(prompt)]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_long_completion_is_cut_at_its_end(family):
    processor = processor_of(family)
    image = picture(0)
    row = image_row(image, "What shape?")
    prompt = hand_prompt(family, processor.tokenizer, [image, "What shape?"])
    collate = VisionChatCollator(processor, len(prompt) + 4)
    batch = collate([row])
    assert batch["input_ids"].tolist() == [prompt + hand_completion()[:4]]
    assert batch["labels"].tolist() == [[-100] * len(prompt) + text_ids("red ")]
    assert batch["prompts"].tolist() == [prompt]
    assert collate.lengths(row) == (len(prompt), len(hand_completion()))  # the completion uncut


def test_a_prompt_only_row_has_no_labels():
    processor = processor_of("llava")
    image = picture(0)
    row = image_row(image, "What shape?", completion=None)
    prompt = hand_prompt("llava", processor.tokenizer, [image, "What shape?"])
    batch = VisionChatCollator(processor, 256)([row])
    assert batch["input_ids"].tolist() == batch["prompts"].tolist() == [prompt]
    assert batch["labels"].tolist() == [[-100] * len(prompt)]


def test_columns_and_prompt_messages_are_carried():
    processor = processor_of("llava")
    rows = [{**image_row(picture(0), "a"), "teacher": "x"}, {**image_row(picture(1), "b"), "teacher": "y"}]
    batch = VisionChatCollator(processor, 256, columns=["teacher"], carry_prompt_messages=True)(rows)
    assert batch["teacher"] == ["x", "y"]
    assert batch["prompt_messages"] == [row["messages"][:1] for row in rows]


# ---- ChatDataModule with a processor ---------------------------------------------------------------------------------


def rows_of(n: int) -> list[dict]:
    """``n`` rows with distinct images and texts (``Row <i>?``)."""
    return [image_row(picture(10 + i), f"Row {i}?", completion=f"answer {i}") for i in range(n)]


def test_options_that_would_cut_images_are_refused_before_loading():
    processor = processor_of("llava")
    rows = rows_of(2)
    with pytest.raises(ValueError, match=r"^assistant_turns='all' is not supported with a processor"):
        ChatDataModule(None, rows, processor=processor, assistant_turns="all")
    with pytest.raises(ValueError, match=r"^truncate_prompts=True would cut image tokens out of prompts"):
        ChatDataModule(None, rows, processor=processor, truncate_prompts=True)
    check_vision_options(assistant_turns="last", truncate_prompts=False)  # the defaults pass


def test_setup_names_the_row_and_path_of_a_missing_image(tmp_path):
    processor = processor_of("llava")
    missing = tmp_path / "nowhere" / "cat.png"
    rows = [*rows_of(2), image_row({"type": "image", "path": str(missing)}, "hi")]
    dm = ChatDataModule(None, rows, processor=processor, batch_size=2)
    with pytest.raises(ValueError) as caught:
        dm.setup("fit")
    assert str(caught.value) == f"train_data row 2: image file {str(missing)!r} does not exist."


def test_setup_refuses_too_long_prompts_with_the_count_and_the_length_that_fits():
    processor = processor_of("llava")
    short = image_row(picture(0), "a")
    long_text = image_row(picture(1), "a much longer question about the picture?")
    two_images = image_row(picture(2), "b", picture(3))
    lengths = [
        len(hand_prompt("llava", processor.tokenizer, [picture(0), "a"])),
        len(hand_prompt("llava", processor.tokenizer, [picture(0), "a much longer question about the picture?"])),
        len(hand_prompt("llava", processor.tokenizer, [picture(0), "b", picture(0)])),
    ]
    max_length = lengths[0] + 3
    assert lengths[1] > lengths[2] > max_length
    dm = ChatDataModule(None, [short, long_text, two_images], processor=processor, max_length=max_length)
    with pytest.raises(ValueError) as caught:
        dm.setup("fit")
    message = str(caught.value)
    assert message.startswith(
        f"train_data: 2 of 3 checked rows have prompts longer than max_length={max_length} (image tokens included; "
        f"first: row 1, {lengths[1]} tokens)"
    )
    assert f"Raise max_length to at least {lengths[1]} (Hydra: data.max_length={lengths[1]})" in message
    ChatDataModule(None, [short, long_text, two_images], processor=processor, max_length=lengths[1]).setup("fit")


def test_a_text_only_datamodule_refuses_a_row_with_an_image(tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        image_row(picture(0), "what?"),
    ]
    dm = ChatDataModule(tokenizer, rows)
    with pytest.raises(ValueError, match=r"^train_data row 1 holds an image, but the data is collated by a text-only "):
        dm.setup("fit")
    column_only = {"messages": rows[0]["messages"], "images": [picture(0)]}
    with pytest.raises(ValueError, match=r"^train_data row 0 holds an image"):
        ChatDataModule(tokenizer, [column_only]).setup("fit")


def test_rows_from_a_jsonl_file_collate_like_the_same_rows_with_pil_images(tmp_path):
    processor = processor_of("idefics3")
    images = [picture(20 + i, size=(32 + 4 * i, 40)) for i in range(4)]
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    on_disk = [
        image_row({"type": "image", "path": str(tmp_path / "0.png")}, "first?"),
        image_row("second", {"type": "image", "image": f"file://{tmp_path / '1.png'}"}),
        image_row(
            {"type": "image"}, "third and", {"type": "image"}, images=[str(tmp_path / "2.png"), str(tmp_path / "3.png")]
        ),
    ]
    in_memory = [
        image_row(images[0], "first?"),
        image_row("second", images[1]),
        image_row(images[2], "third and", images[3]),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in on_disk))
    dm = ChatDataModule(None, str(path), processor=processor, batch_size=3, shuffle=False, max_length=256)
    dm.setup("fit")
    from_file = next(iter(dm.train_dataloader()))
    expected = VisionChatCollator(processor, 256)(in_memory)
    for key in ("input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask"):
        assert torch.equal(from_file[key], expected[key]), key
    assert_same_vision(from_file["vision"], expected["vision"])
    assert from_file["vision"][2]["pixel_values"].shape[1] == 2  # idefics3: a row's two images side by side


def _row_number(batch, index: int, processor) -> int:
    """Which ``rows_of`` row a batch row is, read from its prompt text (``Row <i>?``)."""
    real = batch["prompt_attention_mask"][index].bool()
    text = processor.tokenizer.decode(batch["prompts"][index][real])
    return int(text.split("Row ")[1].split("?")[0])


def test_grouped_generation_keeps_each_rows_images_with_it():
    processor = processor_of("llava")
    rows = rows_of(8)
    expected = [vision_of(processor, row, [picture(10 + i)]) for i, row in enumerate(rows)]
    dm = ChatDataModule(None, rows, processor=processor, batch_size=2, steps_per_generation=2, seed=3, max_length=128)
    dm.setup("fit")
    items = list(dm.train_dataloader())
    assert len(items) == 4
    seen: list[int] = []
    for item in items:
        numbers = [_row_number(item, i, processor) for i in range(2)]
        seen += numbers
        assert_same_vision(item["vision"], [expected[n] for n in numbers])
        group = item[GENERATION_GROUP]
        group_numbers = [_row_number(group, i, processor) for i in range(4)]
        assert_same_vision(group["vision"], [expected[n] for n in group_numbers])
        # sampled completions for the whole group, shuffled and cut: images still follow their rows
        completions = torch.randint(3, 259, (4, 3), generator=torch.Generator().manual_seed(0))
        sampled = {**group, **completion_batch(group["prompts"], group["prompt_attention_mask"], completions, 2)}
        micro_batches = shuffled_micro_batches(sampled, 2, seed=11)
        assert len(micro_batches) == 2
        order = []
        for micro in micro_batches:
            numbers = [_row_number(micro, i, processor) for i in range(2)]
            order += numbers
            assert_same_vision(micro["vision"], [expected[n] for n in numbers])
        assert sorted(order) == sorted(group_numbers)
    assert sorted(seen) == list(range(8))
