"""A conversation to token ids: the prompt/completion split on the rendered text, mapped to tokens through offsets,
every assistant turn's tokens when asked, and left-truncation to ``max_length``. ``ChatMLCollator`` (``chat.py``) and
the preference collator build their batches from it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias, cast

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.images import text_only_messages
from lightning_gkd.data.validation import prompt_cut, prompt_start, whole_prompt_truncated
from lightning_gkd.ops.constants import IGNORE_INDEX

AssistantTurns: TypeAlias = Literal["last", "all"]
ASSISTANT_TURNS = ("last", "all")


@dataclass(frozen=True)
class TokenizedChat:
    """One conversation as token ids; ``ids[:num_prompt_tokens]`` is the prompt, the rest the completion.

    ``earlier_turns``: ``(start, end)`` token ranges inside the prompt that are trained on too: the earlier
    assistant turns, with ``assistant_turns="all"``. ``prompt_ids``: what a model is prompted with to write the
    completion, when the chat template renders that prompt (with its generation prompt) otherwise than the start of
    the conversation (None: ``ids[:num_prompt_tokens]``, the usual case).
    """

    ids: list[int]
    num_prompt_tokens: int
    earlier_turns: tuple[tuple[int, int], ...] = ()
    prompt_ids: list[int] | None = None

    def prompt(self) -> list[int]:
        """The ids a sampler continues: ``prompt_ids``, else the conversation's prompt tokens."""
        return list(self.prompt_ids) if self.prompt_ids is not None else self.ids[: self.num_prompt_tokens]

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
        prompt = None if self.prompt_ids is None else self.prompt_ids[min(cut, len(self.prompt_ids) - 1) :]
        return TokenizedChat(self.ids[cut:], self.num_prompt_tokens - cut, turns, prompt)


def read_chat_template(value: str) -> str:
    """A chat template given as its Jinja text, or as the path of a ``.jinja`` file holding it."""
    if value.endswith(".jinja"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"chat_template file {value!r} does not exist.")
        return path.read_text()
    return value


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The chat template's text for ``messages`` (with the tool schemas ``tools`` where given). Contents given as
    lists of text parts are joined into strings first: a tokenizer's template renders string contents."""
    text = tokenizer.apply_chat_template(
        text_only_messages(messages),
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
    The boundary is found on the text (where the prompt text prefixes the full text) and mapped to tokens through
    offsets, so prompt + completion tokens are exactly the tokens of the full conversation.

    A template whose prompt is not a prefix of the conversation (it moves the system prompt, rewrites earlier turns,
    or opens the generation prompt with text the rendered turn lacks, as an empty reasoning block) is trained on its
    own render of the whole conversation (``_non_prefix_chat``): the completion is the last assistant turn's
    ``{% generation %}`` block where the template marks them, else everything from the start of that turn's content
    (where two renders with different contents part) to the end; the template's render of the prompt is kept as
    ``prompt_ids`` for sampling.
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
    spans = None
    if full_text.startswith(prompt_text) and assistant_turns == "all":
        try:
            spans = _earlier_turn_spans(tokenizer, messages, full_text, tools)
        except ValueError:
            if not (has_completion and has_generation_blocks(tokenizer)):  # else the template's masks locate them
                raise
    elif full_text.startswith(prompt_text):
        spans = []
    if spans is not None:
        ids, (num_prompt, *ends) = _split_at_text_boundaries(
            tokenizer, full_text, [len(prompt_text), *(end for span in spans for end in span)]
        )
        chat = TokenizedChat(ids, num_prompt, tuple(zip(ends[::2], ends[1::2], strict=True)))
    else:
        chat = _non_prefix_chat(tokenizer, messages, prompt_text, full_text, assistant_turns, tools)
        ids, num_prompt = chat.ids, chat.num_prompt_tokens
    if len(ids) > max_length:
        num_completion = len(ids) - num_prompt
        if num_completion >= max_length:
            whole = whole_prompt_truncated(max_length, num_completion)
            raise ValueError(f"{whole} Prompt starts {prompt_text[:60]!r}.")
        if not truncate_prompts:
            raise ValueError(prompt_cut(max_length, num_prompt, num_completion, prompt_start({"messages": messages})))
        chat = chat.keep_last(max_length)
    return chat


#: Two contents for the last assistant turn that differ in their first character: two renders part where it starts.
_SENTINELS = ("Xq7lightning", "Yq7lightning")


def has_generation_blocks(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}`` blocks (what
    ``return_assistant_tokens_mask`` reads)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _non_prefix_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    prompt_text: str,
    full_text: str,
    assistant_turns: AssistantTurns,
    tools: Sequence[Mapping[str, Any]] | None,
) -> TokenizedChat:
    """A conversation ending in an assistant turn whose template does not render the prompt as a prefix of it.

    With ``{% generation %}`` blocks: the template's own assistant-token mask (``return_assistant_tokens_mask``);
    the last masked run is the completion (tokens rendered after it are dropped: generation stops at the turn's
    end), earlier runs are the earlier turns (``assistant_turns="all"``). Otherwise the completion starts where the
    last turn's content starts (the first character at which renders with two different contents differ) and runs
    to the end of the render, its end-of-turn tokens included as in the prefix case; ``assistant_turns="all"`` then
    cannot locate the earlier turns' ends and is refused. ``prompt_ids``: the tokens of ``prompt_text``."""
    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    if has_generation_blocks(tokenizer):
        encoded: Any = tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            tools=[dict(tool) for tool in tools] if tools else None,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
        runs = _runs(mask)
        if not runs:
            raise ValueError(
                "The chat template has {% generation %} blocks but marks no token of the last assistant turn: put "
                "the assistant content (and its end-of-turn text) inside {% generation %}...{% endgeneration %}."
            )
        start, end = runs[-1]
        earlier = tuple(runs[:-1]) if assistant_turns == "all" else ()
        return TokenizedChat(ids[:end], start, earlier, prompt_ids)
    if assistant_turns == "all" and any(message["role"] == "assistant" for message in messages[:-1]):
        raise ValueError(
            "The chat template renders the prompt differently from the start of the conversation and has no "
            "{% generation %} blocks, so the earlier assistant turns cannot be located for assistant_turns='all'. "
            "Use assistant_turns='last' (Hydra: data.assistant_turns=last), or mark the assistant text with "
            "{% generation %}...{% endgeneration %} in the template."
        )
    renders = [
        render_chat(tokenizer, [*messages[:-1], {**messages[-1], "content": sentinel}], tools=tools)
        for sentinel in _SENTINELS
    ]
    start = len(os.path.commonprefix(renders))
    if renders[0][start : start + len(_SENTINELS[0])] != _SENTINELS[0] or not full_text.startswith(renders[0][:start]):
        raise ValueError(
            "The chat template renders the prompt differently from the start of the conversation, and the start of "
            "the last assistant turn's content could not be located in its render (the template changes or moves "
            "that content). Mark the assistant text with {% generation %}...{% endgeneration %} in the template, or "
            "use a template whose prompt is a prefix of the conversation."
        )
    ids, (num_prompt,) = _split_at_text_boundaries(tokenizer, full_text, [start])
    return TokenizedChat(ids, num_prompt, (), prompt_ids)


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of consecutive 1s in ``mask``."""
    runs: list[tuple[int, int]] = []
    for index, value in enumerate(mask):
        if value and (not runs or runs[-1][1] != index):
            runs.append((index, index + 1))
        elif value:
            runs[-1] = (runs[-1][0], index + 1)
    return runs


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
                "data.assistant_turns=last), a chat template that renders every prefix of a conversation as "
                "the start of the whole, or one that marks the assistant text with {% generation %} blocks."
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
