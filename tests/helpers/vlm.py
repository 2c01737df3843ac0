"""Rows with images and hand-built token ids for the tiny vision-language models (lightning_gkd.toy.tiny_vlm)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

# The project tokenizer's ids (tests/data/test_chat.py): 0 pad, 1 <|im_start|>, 2 <|im_end|>, "\n" = 201, " " = 223,
# and a printable ASCII character c is ord(c) - 30 (byte-level, no merges: a text's ids are its characters' ids).
PAD, IM_START, IM_END, NL, SPACE = 0, 1, 2, 201, 223

#: What one image's placeholder becomes in a prompt, per family, as tokens (at the tiny models' image sizes).
IMAGE_EXPANSIONS: dict[str, list[str]] = {
    "llava": ["<image>"] * 4,  # 28 px / 14 px patches = 2x2, CLS dropped
    "gemma3": ["\n", "\n", "<start_of_image>", *["<image_soft_token>"] * 4, "<end_of_image>", "\n", "\n"],
    "idefics3": ["<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"],
    "llava_next": ["<image>"] * 10,  # base 2x2 + one tile 2x2 + a newline per tile row
    "mllama": ["<|image|>"],  # the image reaches the text through cross-attention
}
#: How many image tokens (the model's image token id) one image takes, per family.
IMAGE_TOKEN_COUNTS = {"llava": 4, "gemma3": 4, "idefics3": 4, "llava_next": 10, "mllama": 1}

COMPLETION = "red square"


def text_ids(text: str) -> list[int]:
    """The byte-level tokenizer's ids of printable ASCII ``text`` (spaces and newlines too), by hand."""
    return [{"\n": NL, " ": SPACE}.get(c, ord(c) - 30) for c in text]


def picture(seed: int, size: tuple[int, int] = (40, 40)) -> Image.Image:
    """An RGB image of random pixels, ``size`` = (width, height), distinct per seed."""
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def image_part(image: Any) -> dict[str, Any]:
    return {"type": "image", "image": image}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_row(*parts: Any, completion: str | None = COMPLETION, **extra: Any) -> dict[str, Any]:
    """A user turn of ``parts`` (a string is a text part, a PIL image an image part, a dict a part as is) and an
    assistant turn ``completion`` (none when None)."""
    content = [
        text_part(p) if isinstance(p, str) else image_part(p) if isinstance(p, Image.Image) else dict(p) for p in parts
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if completion is not None:
        messages.append({"role": "assistant", "content": completion})
    return {"messages": messages, **extra}


def image_token_ids(family: str, tokenizer: Any) -> list[int]:
    """The ids one image's placeholder becomes in ``family``'s prompts."""
    return [NL if token == "\n" else tokenizer.convert_tokens_to_ids(token) for token in IMAGE_EXPANSIONS[family]]


def hand_prompt(family: str, tokenizer: Any, parts: Sequence[Any]) -> list[int]:
    """The prompt ids of a one-user-turn row of ``parts`` (strings and images), built by hand:
    ``<|im_start|>user\\n`` + parts + ``<|im_end|>\\n<|im_start|>assistant\\n``."""
    body: list[int] = []
    for part in parts:
        body += text_ids(part) if isinstance(part, str) else image_token_ids(family, tokenizer)
    return [IM_START, *text_ids("user\n"), *body, IM_END, NL, IM_START, *text_ids("assistant\n")]


def hand_completion(text: str = COMPLETION) -> list[int]:
    """The completion ids of an assistant turn ``text``: its characters, ``<|im_end|>``, ``\\n``."""
    return [*text_ids(text), IM_END, NL]


def processor_prompt(processor: Any, row: Mapping[str, Any], images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
    """The processor's own output for the row's prompt (rendered with the generation prompt) and ``images``."""
    messages = row["messages"]
    prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[list(images)] if images else None, return_tensors="pt")


def assert_same_vision(got: Sequence[Mapping[str, torch.Tensor]], want: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Two ``vision`` lists hold the same keys and equal tensors, row by row."""
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert set(a) == set(b), f"row {index}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert a[key].shape == b[key].shape, f"row {index} {key}: {a[key].shape} != {b[key].shape}"
            assert torch.equal(a[key], b[key]), f"row {index} {key} differs"


__all__ = [
    "COMPLETION",
    "IMAGE_EXPANSIONS",
    "IMAGE_TOKEN_COUNTS",
    "IM_END",
    "IM_START",
    "NL",
    "PAD",
    "SPACE",
    "assert_same_vision",
    "hand_completion",
    "hand_prompt",
    "image_part",
    "image_row",
    "image_token_ids",
    "picture",
    "processor_prompt",
    "text_ids",
    "text_part",
]
