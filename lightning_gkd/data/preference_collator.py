"""Preference collation: (prompt, chosen, rejected) rows -> one left-padded batch [chosen rows; rejected rows]."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat_collator import IGNORE_INDEX, ROW_INDEX, left_pad, tokenize_chat
from lightning_gkd.data.preference_validation import REF_FIELDS, pair_format
from lightning_gkd.data.validation import evenly_spaced


@dataclass(frozen=True)
class TokenizedPair:
    """One preference pair as token ids: a shared prompt and two completions (each ending in its EOS)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def tokenize_pair(tokenizer: PreTrainedTokenizerBase, row: Mapping[str, Any]) -> TokenizedPair:
    """Token ids of a validated row, not truncated.

    Conversational rows go through the chat template (the completion is the assistant turn with its end-of-turn
    tokens, as in ``tokenize_chat``); plain strings are tokenized as they are, prompt with the tokenizer's special
    tokens, completion without, plus EOS; pre-tokenized rows are used untouched.
    """
    kind = pair_format(row)
    if kind == "tokenized":
        return TokenizedPair(
            list(row["prompt_input_ids"]), list(row["chosen_input_ids"]), list(row["rejected_input_ids"])
        )
    if kind == "conversational":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "Conversational preference rows need a tokenizer with a chat template. Pass one with "
                "PreferenceDataModule(chat_template=...) (Hydra: data.chat_template=...)."
            )
        chosen = tokenize_chat(tokenizer, [*row["prompt"], *row["chosen"]], max_length=sys.maxsize)
        rejected = tokenize_chat(tokenizer, [*row["prompt"], *row["rejected"]], max_length=sys.maxsize)
        prompt = chosen.ids[: chosen.num_prompt_tokens]
        return TokenizedPair(prompt, chosen.ids[chosen.num_prompt_tokens :], rejected.ids[rejected.num_prompt_tokens :])
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "Plain-text preference rows end each completion with EOS, but the tokenizer has none; "
            "set tokenizer.eos_token."
        )
    prompt = tokenizer(row["prompt"])["input_ids"]
    completions = [
        tokenizer(row[field], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for field in ("chosen", "rejected")
    ]
    return TokenizedPair(list(prompt), *completions)


def truncate(prompt: list[int], completion: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Keep the last ``max_length`` tokens of prompt + completion; at least one prompt token must remain."""
    overflow = len(prompt) + len(completion) - max_length
    if overflow <= 0:
        return prompt, completion
    if overflow >= len(prompt):
        raise ValueError(
            f"max_length={max_length} truncates away the whole prompt: the completion alone has "
            f"{len(completion)} tokens. Raise max_length (Hydra: data.max_length) or shorten the "
            "completion."
        )
    return prompt[overflow:], completion


def truncated_pair(
    tokenizer: PreTrainedTokenizerBase, row: Mapping[str, Any], max_length: int
) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """``((prompt, chosen), (prompt, rejected))`` token ids of a validated row, each side truncated to
    ``max_length`` (``ValueError`` when a prompt would be truncated away)."""
    pair = tokenize_pair(tokenizer, row)
    return truncate(pair.prompt, pair.chosen, max_length), truncate(pair.prompt, pair.rejected, max_length)


def check_pairs_fit(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    name: str,
    max_rows: int | None = 1000,
) -> None:
    """Tokenize up to ``max_rows`` validated rows spread evenly over ``rows`` (all when None) as the collator
    will, raising ``ValueError`` naming the first row whose prompt ``max_length`` would truncate away."""
    for index in evenly_spaced(len(rows), max_rows):
        try:
            truncated_pair(tokenizer, rows[index], max_length)
        except ValueError as error:
            raise ValueError(f"{name} row {index}: {error}") from None


class PreferenceCollator:
    """Collate preference rows into one batch whose first half is prompt+chosen and second half prompt+rejected.

    For ``B`` rows it emits ``input_ids``, ``attention_mask`` and ``labels`` (prompt and padding = -100) of shape
    ``(2B, L)``, all left-padded to one length so a single forward covers both halves; ``prompts`` and
    ``prompt_attention_mask`` ``(B, P)`` for generation; ``index`` ``(B,)`` when rows carry ``row_index``; and
    ``ref_chosen_logps``/``ref_rejected_logps`` ``(B,)`` when every row carries them (precomputed reference).
    Sequences longer than ``max_length`` keep their last ``max_length`` tokens.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int = 1024) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The tokenizer has no pad token; PreferenceDataModule sets it to EOS, or set one yourself."
            )
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        chosen, rejected = [], []
        for row in rows:
            try:
                pair = truncated_pair(self.tokenizer, row, self.max_length)
            except ValueError as error:
                if ROW_INDEX in row:  # name the row: this may be hours into a run
                    raise ValueError(f"row {row[ROW_INDEX]}: {error}") from None
                raise
            chosen.append(pair[0])
            rejected.append(pair[1])
        sequences = chosen + rejected
        full = [prompt + completion for prompt, completion in sequences]
        labels = [[IGNORE_INDEX] * len(prompt) + completion for prompt, completion in sequences]
        prompts = [prompt for prompt, _ in chosen]
        pad_id = self.tokenizer.pad_token_id
        batch = {
            "input_ids": left_pad(full, pad_id),
            "attention_mask": left_pad([[1] * len(ids) for ids in full], 0),
            "labels": left_pad(labels, IGNORE_INDEX),
            "prompts": left_pad(prompts, pad_id),
            "prompt_attention_mask": left_pad([[1] * len(ids) for ids in prompts], 0),
        }
        if all(ROW_INDEX in row for row in rows):
            batch["index"] = torch.tensor([int(row[ROW_INDEX]) for row in rows], dtype=torch.long)
        has_ref = [all(row.get(field) is not None for field in REF_FIELDS) for row in rows]
        if any(has_ref):
            if not all(has_ref):
                raise ValueError(
                    "Some rows of this batch carry precomputed reference log-probs "
                    f"({', '.join(REF_FIELDS)}) and some do not; give them for every row or none."
                )
            for field in REF_FIELDS:
                batch[field] = torch.tensor([float(row[field]) for row in rows], dtype=torch.float32)
        return batch
