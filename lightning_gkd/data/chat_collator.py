"""Chat-ML collation: messages -> left-padded ids with the prompt masked out of the labels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
#: Key under which the DataModules' datasets hand each row's index to the collator (for errors and caches).
ROW_INDEX = "row_index"


@dataclass(frozen=True)
class TokenizedChat:
    """One conversation as token ids; ``ids[:num_prompt_tokens]`` is the prompt, the rest the completion."""

    ids: list[int]
    num_prompt_tokens: int


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
) -> str:
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not the rendered text.")
    return text


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], max_length: int
) -> TokenizedChat:
    """Tokenize a conversation, splitting prompt from completion.

    If the last message is the assistant's, it is the completion (its end-of-turn tokens included) and the prompt
    is the template of the earlier messages with the generation prompt added; otherwise the row is prompt-only.
    The boundary is found on the text (the prompt text must prefix the full text) and mapped to tokens through
    offsets, so prompt + completion tokens are exactly the tokens of the full conversation. Truncation keeps the
    last ``max_length`` tokens.
    """
    has_completion = messages[-1]["role"] == "assistant"
    prompt_messages = list(messages[:-1]) if has_completion else list(messages)
    prompt_text = _render(tokenizer, prompt_messages, add_generation_prompt=True)
    full_text = _render(tokenizer, messages) if has_completion else prompt_text
    if not full_text.startswith(prompt_text):
        raise ValueError(
            "The chat template renders the prompt (with the generation prompt) differently from the "
            "start of the full conversation, so the completion cannot be located. Use a chat "
            f"template whose prompt is a prefix of the conversation. Prompt ends {prompt_text[-60:]!r}, "
            f"conversation has {full_text[len(prompt_text) - 60 : len(prompt_text)]!r} there."
        )
    ids, num_prompt = _split_at_text_boundary(tokenizer, full_text, len(prompt_text))
    if len(ids) > max_length:
        num_completion = len(ids) - num_prompt
        if num_completion >= max_length:
            raise ValueError(
                f"max_length={max_length} truncates away the whole prompt: the completion alone has "
                f"{num_completion} tokens. Raise max_length (Hydra: data.max_length) or shorten the "
                "completion. "
                f"Prompt starts {prompt_text[:60]!r}."
            )
        ids, num_prompt = ids[-max_length:], max_length - num_completion
    return TokenizedChat(ids=ids, num_prompt_tokens=num_prompt)


def _split_at_text_boundary(tokenizer: PreTrainedTokenizerBase, text: str, boundary: int) -> tuple[list[int], int]:
    if tokenizer.is_fast:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        num_prompt = sum(1 for start, _ in encoding["offset_mapping"] if start < boundary)
        return ids, num_prompt
    # Slow tokenizers have no offsets: require that the prompt tokenizes to a prefix of the conversation.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(text[:boundary], add_special_tokens=False)["input_ids"]
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            "The tokenizer merges tokens across the prompt/completion boundary and has no offsets to "
            "split them; use a fast tokenizer (use_fast=True)."
        )
    return ids, len(prompt_ids)


def left_pad(sequences: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """(B, max_len) long tensor, each sequence right-aligned and padded on the left with ``value``."""
    width = max((len(s) for s in sequences), default=0)
    out = torch.full((len(sequences), width), value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            out[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
    return out


class ChatMLCollator:
    """Collate rows with ``messages`` into a left-padded batch.

    Emits ``input_ids``, ``attention_mask``, ``labels`` (prompt and padding = -100) for the whole conversation,
    and ``prompts``, ``prompt_attention_mask`` for the prompt alone (what on-policy sampling continues).
    A row that cannot be used raises ``ValueError``, naming ``f"{name} row {row['row_index']}"`` when rows carry
    their index (ChatDataModule's do).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int = 1024, *, name: str = "data") -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer has no pad token; ChatDataModule sets it to EOS, or set one yourself.")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.name = name

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        chats = [self._tokenize(row) for row in rows]
        pad_id = self.tokenizer.pad_token_id
        full = [chat.ids for chat in chats]
        labels = [[IGNORE_INDEX] * chat.num_prompt_tokens + chat.ids[chat.num_prompt_tokens :] for chat in chats]
        prompts = [chat.ids[: chat.num_prompt_tokens] for chat in chats]
        return {
            "input_ids": left_pad(full, pad_id),
            "attention_mask": left_pad([[1] * len(ids) for ids in full], 0),
            "labels": left_pad(labels, IGNORE_INDEX),
            "prompts": left_pad(prompts, pad_id),
            "prompt_attention_mask": left_pad([[1] * len(ids) for ids in prompts], 0),
        }

    def _tokenize(self, row: Mapping[str, Any]) -> TokenizedChat:
        try:
            return tokenize_chat(self.tokenizer, row["messages"], self.max_length)
        except ValueError as error:
            if ROW_INDEX in row:  # name the row: this may be hours into a run, on a row setup did not sample
                raise ValueError(f"{self.name} row {row[ROW_INDEX]}: {error}") from None
            raise
