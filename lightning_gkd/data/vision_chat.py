"""Chat rows with images -> batches, through a vision-language model's processor.

The processor (``transformers.AutoProcessor``) renders a conversation with its chat template, loads nothing itself
(``data.images`` loads each row's images) and turns the prompt's image placeholders into the model's image tokens,
returning the pixel values and the family's other image inputs. A batch is the text batch of ``ChatMLCollator``
(left-padded ``input_ids``/``attention_mask``/``labels``, ``prompts``/``prompt_attention_mask``) plus ``vision``:
one dict of image tensors per row (``ops.hf.model_inputs``).

Images live in the prompt, so the prompt is never truncated: a row whose prompt (image tokens included) exceeds
``max_length`` is refused, and a long completion is cut at its end.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_gkd.data.chat_tokens import left_pad, read_chat_template
from lightning_gkd.data.images import row_images
from lightning_gkd.data.rows import ROW_INDEX
from lightning_gkd.data.validation import evenly_spaced
from lightning_gkd.ops.constants import IGNORE_INDEX

_T = TypeVar("_T")

#: processor outputs that are the text batch itself (rebuilt by the collator) rather than image inputs
_TEXT_KEYS = ("input_ids", "attention_mask")


def processor_tokenizer(processor: Any) -> Any:
    """The processor's tokenizer (``processor.tokenizer``); ValueError for an object without one."""
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"{type(processor).__name__} has no tokenizer: give a vision-language processor (AutoProcessor of the "
            "student's folder or hub id)."
        )
    return tokenizer


@dataclass(frozen=True)
class VisionChat:
    """One row: prompt ids (image tokens expanded), completion ids, and the row's image inputs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    images: dict[str, torch.Tensor]


def prompt_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages before the last assistant turn (all of them when the row has none)."""
    kept = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    return [dict(message) for message in kept]


def render(processor: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    text = processor.apply_chat_template(
        [dict(message) for message in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not the rendered text.")
    return text


def tokenize_vision_chat(processor: Any, row: Mapping[str, Any], max_length: int) -> VisionChat:
    """The row's prompt (the messages before its last assistant turn, with the generation prompt) through the
    processor with the row's images, and its completion (the rest of the rendered conversation) through the
    tokenizer. ValueError when the prompt alone exceeds ``max_length`` or the template's prompt is not a prefix of
    its conversation; a completion that does not fit is cut at its end."""
    messages = row["messages"]
    has_completion = messages[-1]["role"] == "assistant"
    prompt_text = render(processor, prompt_messages(messages), add_generation_prompt=True)
    full_text = render(processor, messages, add_generation_prompt=False) if has_completion else prompt_text
    if not full_text.startswith(prompt_text):
        raise ValueError(
            "the chat template renders the prompt otherwise than the start of the conversation; with images the "
            "prompt and completion are split on the text, so use a template whose prompt prefixes the conversation."
        )
    images = row_images(row)
    encoded = processor(text=[prompt_text], images=[images] if images else None, return_tensors="pt")
    prompt_ids = encoded["input_ids"][0][encoded["attention_mask"][0].bool()].tolist()
    if len(prompt_ids) > max_length:
        raise ValueError(
            f"its prompt is {len(prompt_ids)} tokens (image tokens included) but max_length is {max_length}; an "
            "image's tokens are never cut: raise max_length (Hydra: data.max_length) or use smaller images."
        )
    tokenizer = processor_tokenizer(processor)
    completion = tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
    length = encoded["input_ids"].shape[1]
    inputs = {
        key: value
        for key, value in encoded.items()
        if key not in _TEXT_KEYS
        and isinstance(value, torch.Tensor)
        and not (value.dim() >= 2 and value.shape[:2] == (1, length))  # per-token: derived from the ids instead
    }
    return VisionChat(prompt_ids, list(completion[: max_length - len(prompt_ids)]), inputs)


class ProcessorCollator:
    """What the collators of rows with images share: the processor and its tokenizer (which must pad), the longest
    sequence, and the name a row's error starts with (``f"{name} row {index}"``)."""

    def __init__(self, processor: Any, max_length: int = 1024, *, name: str = "data") -> None:
        self.processor = processor
        self.tokenizer = processor_tokenizer(processor)
        if self.tokenizer.pad_token_id is None:
            raise ValueError("The processor's tokenizer has no pad token; set processor.tokenizer.pad_token.")
        self.max_length = max_length
        self.name = name

    def named(self, row: Mapping[str, Any], tokenize: Callable[[Any, Mapping[str, Any], int], _T]) -> _T:
        """``tokenize(processor, row, max_length)``, a ``ValueError`` it raises naming the row."""
        try:
            return tokenize(self.processor, row, self.max_length)
        except ValueError as error:
            where = f"{self.name} row {row[ROW_INDEX]}" if ROW_INDEX in row else self.name
            raise ValueError(f"{where}: {error}") from None


class VisionChatCollator(ProcessorCollator):
    """Collate chat rows that may hold images into the batch of ``ChatMLCollator`` plus ``vision`` (see the module
    docstring). Labels are the last assistant turn (its content and end-of-turn tokens). ``columns`` and
    ``carry_prompt_messages`` as in ``ChatMLCollator``. A row that cannot be used raises ``ValueError`` naming it."""

    def __init__(
        self,
        processor: Any,
        max_length: int = 1024,
        *,
        name: str = "data",
        columns: Sequence[str] = (),
        carry_prompt_messages: bool = False,
    ) -> None:
        super().__init__(processor, max_length, name=name)
        self.columns = list(columns)
        self.carry_prompt_messages = carry_prompt_messages

    def tokenize(self, row: Mapping[str, Any]) -> VisionChat:
        return self.named(row, tokenize_vision_chat)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        chats = [self.tokenize(row) for row in rows]
        pad_id = self.tokenizer.pad_token_id
        full = [chat.prompt_ids + chat.completion_ids for chat in chats]
        labels = [[IGNORE_INDEX] * len(chat.prompt_ids) + chat.completion_ids for chat in chats]
        prompts = [chat.prompt_ids for chat in chats]
        batch: dict[str, Any] = {
            "input_ids": left_pad(full, pad_id),
            "attention_mask": left_pad([[1] * len(ids) for ids in full], 0),
            "labels": left_pad(labels, IGNORE_INDEX),
            "prompts": left_pad(prompts, pad_id),
            "prompt_attention_mask": left_pad([[1] * len(ids) for ids in prompts], 0),
            "vision": [chat.images for chat in chats],
            **{column: [row.get(column) for row in rows] for column in self.columns},
        }
        if self.carry_prompt_messages:
            batch["prompt_messages"] = [
                [
                    dict(m)
                    for m in (row["messages"][:-1] if row["messages"][-1]["role"] == "assistant" else row["messages"])
                ]
                for row in rows
            ]
        return batch

    def lengths(self, row: Mapping[str, Any]) -> tuple[int, int]:
        """The row's ``(prompt tokens, completion tokens)`` (the completion uncut)."""
        chat = tokenize_vision_chat(self.processor, row, max_length=2**31 - 1)
        return len(chat.prompt_ids), len(chat.completion_ids)


def check_vision_options(*, assistant_turns: str, truncate_prompts: bool) -> None:
    """The chat options rows with images do not take, refused before anything loads."""
    if assistant_turns != "last":
        raise ValueError(
            f"assistant_turns={assistant_turns!r} is not supported with a processor (rows with images): the "
            "completion is the last assistant turn. Use assistant_turns='last' (Hydra: data.assistant_turns=last)."
        )
    if truncate_prompts:
        raise ValueError(
            "truncate_prompts=True would cut image tokens out of prompts; with a processor prompts are never "
            "truncated. Set truncate_prompts=False (Hydra: data.truncate_prompts=false) and a max_length that fits."
        )


def check_vision_prompt_lengths(
    rows: Sequence[Mapping[str, Any]],
    lengths: Any,
    *,
    name: str,
    max_length: int,
    max_rows: int | None,
) -> None:
    """ValueError, with their count, the first one and the ``max_length`` that fits them, when prompts (image tokens
    included) of up to ``max_rows`` rows spread evenly exceed ``max_length``: an image's tokens are never cut.
    ``lengths(row)`` gives ``(prompt tokens, completion tokens)``."""
    indices = evenly_spaced(len(rows), max_rows)
    too_long: list[tuple[int, int]] = []
    for index in indices:
        try:
            num_prompt, _ = lengths(rows[index])
        except ValueError as error:
            raise ValueError(f"{name} row {index}: {error}") from None
        if num_prompt > max_length:
            too_long.append((index, num_prompt))
    if too_long:
        needed = max(length for _, length in too_long)
        index, length = too_long[0]
        raise ValueError(
            f"{name}: {len(too_long)} of {len(indices)} checked rows have prompts longer than max_length={max_length} "
            f"(image tokens included; first: row {index}, {length} tokens), and an image's tokens are never cut. "
            f"Raise max_length to at least {needed} (Hydra: data.max_length={needed}), use smaller images, or drop "
            "those rows."
        )


#: files in a model folder that mean it has a processor (``AutoProcessor`` loads it)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def has_processor(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` (a local model folder) holds a processor's config."""
    return any((Path(folder) / name).is_file() for name in PROCESSOR_FILES)


def prepare_processor(processor: Any, chat_template: str | None) -> Any:
    """A DataModule's processor: loaded when given as a folder or hub id, its chat template replaced by
    ``chat_template`` (the Jinja text or a ``.jinja`` file) when given; None stays None (text rows)."""
    if isinstance(processor, (str, os.PathLike)):
        processor = load_processor(processor)
    if processor is not None and chat_template is not None:
        processor.chat_template = read_chat_template(chat_template)
    return processor


def load_processor(source: str | os.PathLike) -> Any:
    """``AutoProcessor.from_pretrained(source)``, with its image processor on the PIL backend where torchvision does
    not import (CPU machines whose torchvision wheel does not match torch)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(source))
