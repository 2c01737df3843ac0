"""A conversation to token ids: the prompt/completion split on the rendered text, mapped to tokens through offsets,
every assistant turn's tokens when asked, and left-truncation to ``max_length``. ``ChatMLCollator`` (``chat.py``) and
the preference collator build their batches from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.validation import prompt_cut, prompt_start, whole_prompt_truncated
from lightning_gkd.ops.losses import IGNORE_INDEX

AssistantTurns: TypeAlias = Literal["last", "all"]
ASSISTANT_TURNS = ("last", "all")


@dataclass(frozen=True)
class TokenizedChat:
    """One conversation as token ids; ``ids[:num_prompt_tokens]`` is the prompt, the rest the completion.

    ``earlier_turns``: ``(start, end)`` token ranges inside the prompt that are trained on too: the earlier
    assistant turns, with ``assistant_turns="all"``.
    """

    ids: list[int]
    num_prompt_tokens: int
    earlier_turns: tuple[tuple[int, int], ...] = ()

    def labels(self) -> list[int]:
        """The ids of the completion and of ``earlier_turns``, ``IGNORE_INDEX`` elsewhere."""
        labels = [IGNORE_INDEX] * self.num_prompt_tokens + self.ids[self.num_prompt_tokens :]
        for start, end in self.earlier_turns:
            labels[start:end] = self.ids[start:end]
        return labels

    def keep_last(self, max_length: int) -> TokenizedChat:
        """The last ``max_length`` tokens (the prompt loses its beginning; earlier turns are cut with it)."""
        cut = max(len(self.ids) - max_length, 0)
        if cut == 0:
            return self
        turns = tuple((max(start - cut, 0), end - cut) for start, end in self.earlier_turns if end > cut)
        return TokenizedChat(self.ids[cut:], self.num_prompt_tokens - cut, turns)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The chat template's text for ``messages`` (with the tool schemas ``tools`` where given)."""
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tools=[dict(tool) for tool in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not the rendered text.")
    return text


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    max_length: int,
    *,
    assistant_turns: AssistantTurns = "last",
    truncate_prompts: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> TokenizedChat:
    """Tokenize a conversation, splitting prompt from completion.

    If the last message is the assistant's, it is the completion (its end-of-turn tokens included) and the prompt
    is the template of the earlier messages with the generation prompt added; otherwise the row is prompt-only.
    The boundary is found on the text (the prompt text must prefix the full text) and mapped to tokens through
    offsets, so prompt + completion tokens are exactly the tokens of the full conversation.
    ``assistant_turns="all"`` also marks every earlier assistant turn (``earlier_turns``), found the same way:
    from the render of the messages before it with the generation prompt to the render through it.
    ``tools``: the tool schemas the template renders (a tool-calling conversation; its tool messages are never
    labels). Truncation keeps the last ``max_length`` tokens; a prompt truncated away is a ``ValueError``, and so is a
    prompt that would lose its beginning unless ``truncate_prompts``.
    """
    has_completion = messages[-1]["role"] == "assistant"
    prompt_messages = list(messages[:-1]) if has_completion else list(messages)
    prompt_text = render_chat(tokenizer, prompt_messages, add_generation_prompt=True, tools=tools)
    full_text = render_chat(tokenizer, messages, tools=tools) if has_completion else prompt_text
    if not full_text.startswith(prompt_text):
        raise ValueError(
            "The chat template renders the prompt (with the generation prompt) differently from the "
            "start of the full conversation, so the completion cannot be located. Use a chat "
            f"template whose prompt is a prefix of the conversation. Prompt ends {prompt_text[-60:]!r}, "
            f"conversation has {full_text[len(prompt_text) - 60 : len(prompt_text)]!r} there."
        )
    spans = _earlier_turn_spans(tokenizer, messages, full_text, tools) if assistant_turns == "all" else []
    ids, (num_prompt, *ends) = _split_at_text_boundaries(
        tokenizer, full_text, [len(prompt_text), *(end for span in spans for end in span)]
    )
    chat = TokenizedChat(ids, num_prompt, tuple(zip(ends[::2], ends[1::2], strict=True)))
    if len(ids) > max_length:
        num_completion = len(ids) - num_prompt
        if num_completion >= max_length:
            whole = whole_prompt_truncated(max_length, num_completion)
            raise ValueError(f"{whole} Prompt starts {prompt_text[:60]!r}.")
        if not truncate_prompts:
            raise ValueError(prompt_cut(max_length, num_prompt, num_completion, prompt_start({"messages": messages})))
        chat = chat.keep_last(max_length)
    return chat


def _earlier_turn_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    full_text: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[tuple[int, int]]:
    """Character ranges of ``full_text`` holding the assistant turns before the last message: each from the end of
    the render of the messages before it with the generation prompt to the end of the render through it (its
    end-of-turn tokens included, as the completion's are)."""
    spans = []
    for turn in range(len(messages) - 1):
        if messages[turn]["role"] != "assistant":
            continue
        start = render_chat(tokenizer, messages[:turn], add_generation_prompt=True, tools=tools)
        through = render_chat(tokenizer, messages[: turn + 1], tools=tools)
        if not (through.startswith(start) and full_text.startswith(through)):
            raise ValueError(
                f"The chat template renders the conversation up to assistant message {turn} differently from the "
                "start of the full conversation (e.g. it drops the reasoning of earlier turns), so that turn "
                "cannot be located for assistant_turns='all'. Use assistant_turns='last' (Hydra: "
                "data.assistant_turns=last), or a chat template that renders every prefix of a conversation as "
                "the start of the whole."
            )
        spans.append((len(start), len(through)))
    return spans


def _split_at_text_boundaries(
    tokenizer: PreTrainedTokenizerBase, text: str, boundaries: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The ids of ``text`` and, for each character boundary, the number of tokens that start before it."""
    if tokenizer.is_fast:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in encoding["offset_mapping"]]
        return list(encoding["input_ids"]), [sum(1 for start in starts if start < b) for b in boundaries]
    # Slow tokenizers have no offsets: require that each prefix tokenizes to a prefix of the conversation.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    counts = []
    for boundary in boundaries:
        prefix = tokenizer(text[:boundary], add_special_tokens=False)["input_ids"]
        if ids[: len(prefix)] != prefix:
            raise ValueError(
                "The tokenizer merges tokens across the prompt/completion boundary and has no offsets to "
                "split them; use a fast tokenizer (use_fast=True)."
            )
        counts.append(len(prefix))
    return list(ids), counts


def left_pad(sequences: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """(B, max_len) long tensor, each sequence right-aligned and padded on the left with ``value``."""
    width = max((len(s) for s in sequences), default=0)
    out = torch.full((len(sequences), width), value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            out[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
    return out


def check_assistant_turns(value: str) -> AssistantTurns:
    if value not in ASSISTANT_TURNS:
        raise ValueError(
            f"assistant_turns must be 'last' (train on the last assistant turn) or 'all' (every assistant turn), "
            f"got {value!r}. Hydra: data.assistant_turns=all."
        )
    return cast(AssistantTurns, value)
