"""Forwards over left-padded batches whose rows hold images (lightning_gkd.ops.hf.model_inputs), for every tiny VLM
family: merged image inputs, the per-token inputs derived from the ids against the processor's own, a batch's logits
against each row alone, the lean path against the full logits, and greedy decoding against ``model.generate``."""

from __future__ import annotations

import pytest
import torch
from helpers.vlm import hand_completion, image_row, picture, processor_prompt

from lightning_gkd.data.vision_chat import VisionChatCollator
from lightning_gkd.ops.decoding.sampling import complete_prompts
from lightning_gkd.ops.hf.forward import position_ids_from_mask
from lightning_gkd.ops.hf.heads import hidden_states_and_head
from lightning_gkd.ops.hf.model_inputs import (
    causal_lm_logits,
    has_images,
    image_token_id,
    lm_inputs,
    merge_row_inputs,
    select_rows,
    token_type_inputs,
)
from lightning_gkd.toy.tiny_vlm import VLM_FAMILIES, tiny_vlm

_BUILT: dict[str, tuple] = {}


def vlm(family: str):
    """``tiny_vlm(family)``, built once per module."""
    if family not in _BUILT:
        _BUILT[family] = tiny_vlm(family, seed=0)
    return _BUILT[family]


def uneven_rows() -> list[dict]:
    """Rows of different text lengths, image positions and image counts (1 and 2), with uneven completions."""
    return [
        image_row(picture(0), "What shape?"),
        image_row("Hi, compare", picture(1, size=(30, 50)), "with", picture(2), completion="the same thing"),
        image_row("Is this one red?", picture(3), completion="no"),
    ]


def first_image_column(batch: dict, row: int, token: int) -> int:
    return int((batch["input_ids"][row] == token).nonzero()[0])


# ---- merge_row_inputs ------------------------------------------------------------------------------------------------


def test_merge_concatenates_rows_and_zero_pads_uneven_dims():
    a = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2) + 1
    b = torch.arange(1 * 1 * 4, dtype=torch.float32).reshape(1, 1, 4) + 100
    sizes_a, sizes_b = torch.tensor([[4, 5], [6, 7]]), torch.tensor([[8, 9]])
    merged = merge_row_inputs(
        [{"pixel_values": a, "image_sizes": sizes_a}, {}, {"pixel_values": b, "image_sizes": sizes_b}]
    )
    assert set(merged) == {"pixel_values", "image_sizes"}
    assert merged["pixel_values"].shape == (3, 3, 4)
    assert torch.equal(merged["pixel_values"][:2, :, :2], a)
    assert torch.equal(merged["pixel_values"][:2, :, 2:], torch.zeros(2, 3, 2))
    assert torch.equal(merged["pixel_values"][2, :1], b[0])
    assert torch.equal(merged["pixel_values"][2, 1:], torch.zeros(2, 4))
    assert merged["image_sizes"].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert merged["pixel_values"].dtype == torch.float32 and merged["image_sizes"].dtype == torch.long


def test_merge_of_equal_shapes_is_a_plain_concatenation_and_scalars_stack():
    rows = [{"x": torch.randn(1, 2, 3), "n": torch.tensor(1)}, {"x": torch.randn(2, 2, 3), "n": torch.tensor(2)}]
    merged = merge_row_inputs(rows)
    assert torch.equal(merged["x"], torch.cat([rows[0]["x"], rows[1]["x"]]))
    assert merged["n"].tolist() == [1, 2]


def test_merge_skips_rows_without_images():
    assert merge_row_inputs([{}, {}]) == {}
    only = {"pixel_values": torch.randn(1, 3, 4, 4)}
    merged = merge_row_inputs([{}, only, {}])
    assert torch.equal(merged["pixel_values"], only["pixel_values"])


def test_merge_refuses_ranks_that_differ_and_keys_missing_from_a_row():
    with pytest.raises(
        ValueError, match=r"image input 'pixel_values' has rows of different ranks: \[\(1, 3\), \(1, 3, 1\)\]"
    ):
        merge_row_inputs([{"pixel_values": torch.zeros(1, 3)}, {"pixel_values": torch.zeros(1, 3, 1)}])
    with pytest.raises(ValueError, match=r"image input 'image_sizes' is in 1 of the 2 rows with images"):
        merge_row_inputs(
            [{"pixel_values": torch.zeros(1, 3), "image_sizes": torch.zeros(1, 2)}, {"pixel_values": torch.zeros(1, 3)}]
        )


def test_select_rows_and_has_images():
    rows = [{"a": torch.tensor(0)}, {}, {"a": torch.tensor(2)}]
    assert select_rows(None, [0]) is None
    picked = select_rows(rows, torch.tensor([2, 0]))
    assert [int(r["a"]) for r in picked] == [2, 0]
    assert picked[0] is not rows[2]  # new dicts: a micro-batch may change its rows' dicts
    assert has_images(rows) and not has_images([{}, {}]) and not has_images(None) and not has_images([])


# ---- per family: the inputs of a forward -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_lm_inputs_without_images_are_the_text_inputs(family):
    model, processor = vlm(family)
    batch = VisionChatCollator(processor, 256)(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    )
    for vision in (None, batch["vision"]):
        inputs = lm_inputs(model, batch["input_ids"], batch["attention_mask"], vision)
        assert set(inputs) == {"input_ids", "attention_mask", "position_ids"}
        assert torch.equal(inputs["position_ids"], position_ids_from_mask(batch["attention_mask"]))


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_per_token_inputs_equal_the_processors(family):
    """gemma3's token_type_ids and mllama's cross_attention_mask, derived from a left-padded batch's ids, equal what
    the processor returns for each row alone; the other families take none."""
    model, processor = vlm(family)
    rows = uneven_rows()
    if family == "mllama":  # two images in a row, then one apart: a run of image tokens shares its end
        rows.append(image_row(picture(4), picture(5), "and", picture(6), "end"))
    images = [[p["image"] for p in row["messages"][0]["content"] if p["type"] == "image"] for row in rows]
    batch = VisionChatCollator(processor, 256)(rows)
    inputs = lm_inputs(model, batch["prompts"], batch["prompt_attention_mask"], batch["vision"])
    derived = token_type_inputs(model, batch["prompts"], merge_row_inputs(batch["vision"]))
    expected_keys = {"gemma3": {"token_type_ids"}, "mllama": {"cross_attention_mask"}}.get(family, set())
    assert set(derived) == expected_keys
    for key in expected_keys:
        assert torch.equal(inputs[key], derived[key])
    for index, (row, row_images) in enumerate(zip(rows, images, strict=True)):
        own = processor_prompt(processor, row, row_images)
        real = batch["prompt_attention_mask"][index].bool()
        assert batch["prompts"][index][real].tolist() == own["input_ids"][0].tolist()
        if family == "gemma3":
            assert own["token_type_ids"][0].tolist() == derived["token_type_ids"][index][real].tolist()
            assert sum(own["token_type_ids"][0].tolist()) == 4 * len(row_images)
            assert derived["token_type_ids"][index][~real].sum() == 0
        if family == "mllama":
            n = len(row_images)
            mask = derived["cross_attention_mask"][index]  # (L, N, T): N the batch's most images
            assert torch.equal(mask[real][:, :n], own["cross_attention_mask"][0].long())
            assert mask[:, n:].sum() == 0 and mask[~real].sum() == 0
    if family == "mllama":
        spans = derived["cross_attention_mask"][3, :, :, 0].T  # (images, L) of the row with three images
        starts = [int((span == 1).nonzero()[0]) for span in spans]
        assert starts[1] == starts[0] + 1  # adjacent image tokens ...
        assert (
            spans[0].sum() == spans[1].sum() + 1 and spans[0][-1] == spans[1][-1] == 0
        )  # ... end where the third starts
        assert spans[2][starts[2] :].all()  # the last image is seen to the end of the row


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_batch_logits_equal_each_row_alone(family):
    """Left padding, other rows' images and zero-padded image inputs change no row's logits."""
    model, processor = vlm(family)
    collate = VisionChatCollator(processor, 256)
    rows = uneven_rows()
    batch = collate(rows)
    token = image_token_id(model)
    with torch.no_grad():
        logits = causal_lm_logits(model, batch)
        for index, row in enumerate(rows):
            alone = collate([row])
            own = causal_lm_logits(model, alone)[0]
            start = 0
            if family == "mllama" and len(alone["vision"][0]["pixel_values"][0]) < 2:
                # transformers' Mllama: a token before its row's first image (a fully masked cross-attention row)
                # attends to every vision token of the row, padding images included (the processor's own batch
                # does the same), so only positions from the first image on are the row's alone. The tiny model's
                # cross-attention layer is its last, so nothing later carries it on.
                start = first_image_column(alone, 0, token)
            width = own.shape[0]
            torch.testing.assert_close(logits[index, -width:][start:], own[start:], rtol=0, atol=1e-5)
            if start:
                assert (logits[index, -width:][:start] - own[:start]).abs().max() > 1e-4


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_images_reach_the_supervised_logits(family):
    model, processor = vlm(family)
    collate = VisionChatCollator(processor, 256)
    one, other = collate([image_row(picture(0), "What shape?")]), collate([image_row(picture(9), "What shape?")])
    assert torch.equal(one["input_ids"], other["input_ids"])
    with torch.no_grad():
        difference = (causal_lm_logits(model, one) - causal_lm_logits(model, other))[0, -len(hand_completion()) :]
    assert difference.abs().max() > 1e-3


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_lean_hidden_states_and_head_equal_the_full_logits(family):
    model, processor = vlm(family)
    batch = VisionChatCollator(processor, 256)(uneven_rows())
    supervised = torch.roll(batch["labels"] != -100, -1, 1)  # the positions whose logits predict a label
    with torch.no_grad():
        full = causal_lm_logits(model, batch)
        hidden, head = hidden_states_and_head(
            model, batch["input_ids"], batch["attention_mask"], supervised, batch["vision"]
        )
    assert hidden.shape == (int(supervised.sum()), model.config.get_text_config().hidden_size)
    torch.testing.assert_close(head.logits(hidden), full[supervised].float(), rtol=0, atol=1e-5)


# ---- greedy decoding with images -------------------------------------------------------------------------------------


def hf_greedy(model, batch: dict, max_new_tokens: int) -> list[int]:
    """``model.generate`` greedy on a one-row batch's prompt with its image inputs (lm_inputs, positions left to
    generate)."""
    inputs = lm_inputs(model, batch["prompts"], batch["prompt_attention_mask"], batch["vision"])
    inputs.pop("position_ids", None)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, batch["prompts"].shape[1] :].tolist()


def completion_tokens(out: dict, prompt_width: int, row: int) -> list[int]:
    """A row's generated tokens up to and including its EOS (2), without the padding after it."""
    return out["input_ids"][row, prompt_width:][out["attention_mask"][row, prompt_width:].bool()].tolist()


def greedy(model, processor, batch: dict, new: int) -> dict:
    return complete_prompts(
        model,
        processor.tokenizer,
        batch["prompts"],
        batch["prompt_attention_mask"],
        max_new_tokens=new,
        vision=batch["vision"],
    )


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_greedy_decoding_equals_generate_per_row(family):
    model, processor = vlm(family)
    collate = VisionChatCollator(processor, 256)
    for row in uneven_rows():
        alone = collate([row])
        out = greedy(model, processor, alone, 6)
        width = alone["prompts"].shape[1]
        mine = completion_tokens(out, width, 0)
        assert mine == hf_greedy(model, alone, 6)[: len(mine)]
        assert len(mine) == 6 or mine[-1] == 2  # stopped only at EOS
        assert torch.equal(out["input_ids"][0, :width], alone["prompts"][0])
        assert out["vision"] is alone["vision"]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_batched_greedy_equals_per_row_greedy_and_the_full_forward(family):
    model, processor = vlm(family)
    collate = VisionChatCollator(processor, 256)
    rows = uneven_rows()
    per_row = []
    for row in rows:
        alone = collate([row])
        per_row.append(completion_tokens(greedy(model, processor, alone, 6), alone["prompts"].shape[1], 0))
    assert len({tuple(tokens) for tokens in per_row}) > 1  # the rows' images and texts lead somewhere different
    batch = collate(rows)
    out = greedy(model, processor, batch, 6)
    width = batch["prompts"].shape[1]
    assert [completion_tokens(out, width, i) for i in range(len(rows))] == per_row
    # the training forward over the sampled batch picks the decoded tokens: sampling and training see the same images
    with torch.no_grad():
        full = causal_lm_logits(model, out)
    picked = full[:, width - 1 : -1].argmax(-1)
    decoded = out["input_ids"][:, width:]
    assert torch.equal(
        picked[out["attention_mask"][:, width:].bool()], decoded[out["attention_mask"][:, width:].bool()]
    )


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_text_only_row_among_rows_with_images(family):
    model, processor = vlm(family)
    collate = VisionChatCollator(processor, 256)
    text_row = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    rows = [text_row, image_row(picture(0), "What shape?")]
    batch = collate(rows)
    assert batch["vision"][0] == {}
    if family == "mllama":  # images through cross-attention, one entry per row: refused, naming what to do
        with pytest.raises(ValueError, match="every row of a batch needs an image"):
            causal_lm_logits(model, batch)
        return
    with torch.no_grad():
        logits = causal_lm_logits(model, batch)
        for index, row in enumerate(rows):
            own = causal_lm_logits(model, collate([row]))[0]
            torch.testing.assert_close(logits[index, -own.shape[0] :], own, rtol=0, atol=1e-5)
