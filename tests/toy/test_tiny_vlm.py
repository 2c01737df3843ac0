"""Tiny vision-language models: size, processor outputs, forward, save/load round trip and generation per family."""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, BatchFeature

from lightning_gkd.data.tokenizer import CHATML_TEMPLATE, build_chatml_tokenizer
from lightning_gkd.toy.tiny_vlm import (
    UNSUPPORTED_VLM_FAMILIES,
    VLM_FAMILIES,
    image_placeholder,
    tiny_vlm,
    vlm_chat_template,
    vlm_tokenizer,
    write_tiny_vlm,
)

BASE_KEYS = {"input_ids", "attention_mask", "pixel_values"}
#: What each family's processor returns, and how many image tokens one image becomes.
EXPECTED_KEYS = {
    "llava": BASE_KEYS,
    "gemma3": BASE_KEYS | {"token_type_ids"},
    "idefics3": BASE_KEYS | {"pixel_attention_mask"},
    "qwen2_vl": BASE_KEYS | {"image_grid_thw", "mm_token_type_ids"},
    "llava_next": BASE_KEYS | {"image_sizes"},
    "smolvlm": BASE_KEYS | {"pixel_attention_mask"},
    "mllama": BASE_KEYS | {"aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"},
    "paligemma": BASE_KEYS | {"token_type_ids"},
}
IMAGE_TOKENS = {
    "llava": 4,
    "gemma3": 4,
    "idefics3": 4,
    "qwen2_vl": 4,
    "llava_next": 10,
    "smolvlm": 4,
    "mllama": 1,
    "paligemma": 4,
}
ROWS = [
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape?"}]},
        {"role": "assistant", "content": "red square"},
    ],
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And what shape is this one?"}]},
        {"role": "assistant", "content": "a small blue circle"},
    ],
]


def _images() -> list[list[Image.Image]]:
    """One small random image per row, of different sizes and aspect ratios."""
    rng = np.random.default_rng(0)
    return [
        [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))]
        for height, width in ((32, 40), (48, 36))
    ]


def _inputs(processor, padding_side: str = "right") -> BatchFeature:
    """``ROWS`` rendered by the processor's chat template and processed with ``_images()``."""
    processor.tokenizer.padding_side = padding_side
    texts = [processor.apply_chat_template(row, tokenize=False) for row in ROWS]
    return processor(text=texts, images=_images(), padding=True, return_tensors="pt")


@cache
def _built(family: str):
    """The default tiny model and processor of ``family`` (built once per test session)."""
    return tiny_vlm(family)


def test_at_least_four_families_and_reasons_for_the_rest() -> None:
    assert len(VLM_FAMILIES) >= 4
    assert {"llava", "gemma3", "idefics3"} <= set(VLM_FAMILIES)
    assert not set(VLM_FAMILIES) & set(UNSUPPORTED_VLM_FAMILIES)
    assert all(reason for reason in UNSUPPORTED_VLM_FAMILIES.values())
    with pytest.raises(ValueError, match="Unsupported VLM family"):
        tiny_vlm("not_a_family")


def test_chat_template_renders_parts_and_strings_like_chatml() -> None:
    template = vlm_chat_template("<IMG>")
    tokenizer = build_chatml_tokenizer()
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for prompt in (False, True):
        expected = tokenizer.apply_chat_template(
            plain, chat_template=CHATML_TEMPLATE, tokenize=False, add_generation_prompt=prompt
        )
        assert (
            tokenizer.apply_chat_template(plain, chat_template=template, tokenize=False, add_generation_prompt=prompt)
            == expected
        )
    rendered = tokenizer.apply_chat_template(
        ROWS[0][:1], chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\n<IMG>What shape?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_tokenizer_keeps_chatml_ids_and_adds_image_tokens(family: str) -> None:
    tokenizer = vlm_tokenizer(family)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert len(tokenizer) > 259
    placeholder = image_placeholder(family)
    ids = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
    assert all(index >= 259 for index in ids), "the placeholder is made of added special tokens"


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_builds_small_and_fast(family: str) -> None:
    start = time.perf_counter()
    model, processor = tiny_vlm(family, seed=1)
    assert time.perf_counter() - start < 2.0
    assert sum(parameter.numel() for parameter in model.parameters()) < 5_000_000
    tokenizer = processor.tokenizer
    assert model.config.get_text_config().vocab_size == len(tokenizer)
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids(processor.image_token) or family == "gemma3"
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (2, 0)
    assert type(processor.image_processor).__name__.endswith("Pil")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_processor_outputs_and_forward(family: str) -> None:
    model, processor = _built(family)
    inputs = _inputs(processor)
    assert set(inputs) == EXPECTED_KEYS[family]
    input_ids = inputs["input_ids"]
    assert input_ids.shape[0] == 2
    assert (inputs["attention_mask"] == 0).any(), "the rows have different lengths, so one is padded"
    image_counts = (input_ids == model.config.image_token_id).sum(dim=1)
    assert image_counts.tolist() == [IMAGE_TOKENS[family]] * 2
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (*input_ids.shape, len(processor.tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_image_changes_the_logits(family: str) -> None:
    model, processor = _built(family)
    inputs = _inputs(processor)
    with torch.no_grad():
        logits = model(**inputs).logits
        flipped = model(**{**inputs, "pixel_values": inputs["pixel_values"].flip(-1)}).logits
    assert (logits - flipped).abs().max() > 1e-3


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_overrides_reach_the_configs_and_the_image_processor(family: str) -> None:
    model, processor = tiny_vlm(family, seed=3, text={"hidden_size": 32, "intermediate_size": 64}, image_size=64)
    assert model.config.get_text_config().hidden_size == 32
    assert model.config.vision_config.image_size == 64
    inputs = _inputs(processor)
    assert inputs["pixel_values"].shape[-2:] == (64, 64)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (*inputs["input_ids"].shape, len(processor.tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_round_trip_through_a_folder(family: str, tmp_path: Path) -> None:
    model, processor = _built(family)
    folder = write_tiny_vlm(family, tmp_path / family)
    loaded_model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    loaded_processor = AutoProcessor.from_pretrained(folder, backend="pil")
    assert type(loaded_processor) is type(processor)
    assert type(loaded_processor.image_processor) is type(processor.image_processor)
    assert loaded_processor.chat_template == processor.chat_template
    inputs, loaded_inputs = _inputs(processor), _inputs(loaded_processor)
    assert set(loaded_inputs) == set(inputs)
    for key, value in inputs.items():
        assert torch.equal(loaded_inputs[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(loaded_model(**loaded_inputs).logits, model(**inputs).logits)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_greedy_generation(family: str) -> None:
    model, processor = _built(family)
    inputs = _inputs(processor, padding_side="left")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    assert prompt_length < output.shape[1] <= prompt_length + 4
    assert torch.equal(output[:, :prompt_length], inputs["input_ids"])
