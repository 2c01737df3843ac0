"""Preference collation: (prompt, chosen, rejected) rows -> one left-padded batch [chosen rows; rejected rows]."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import left_pad, prepare_tokenizer, tokenize_chat
from lightning_gkd.data.preference_validation import REF_FIELDS, pair_format, validate_preference_rows
from lightning_gkd.data.rows import ROW_INDEX, RowsDataModule
from lightning_gkd.data.sources import DataSource, load_rows
from lightning_gkd.data.validation import check_rows_tokenize
from lightning_gkd.ops.losses import IGNORE_INDEX


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


Collator = Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]


class PreferenceDataModule(RowsDataModule):
    """Batches of preference pairs for ``DPOModule``.

    Args:
        tokenizer: a tokenizer (or a folder / hub id to load one from); conversational rows need a chat template.
        train_data, val_data: a ``datasets.Dataset``, a list of dicts, a local ``.json``/``.jsonl``/``.parquet``
            file or dataset folder, or a hub dataset id. Rows hold ``prompt``, ``chosen``, ``rejected`` as plain
            strings or as message lists (``prompt``: the conversation so far; ``chosen``/``rejected``: one
            assistant message each), or pre-tokenized ``prompt_input_ids``/``chosen_input_ids``/
            ``rejected_input_ids`` (used untouched). Optional ``ref_chosen_logps``/``ref_rejected_logps``: reference
            log-probs computed elsewhere.
        batch_size: pairs per training batch (the model sees ``2 * batch_size`` sequences); ``val_batch_size``
            defaults to it.
        max_length: prompt + completion longer than this keeps its last ``max_length`` tokens.
        chat_template: overrides the tokenizer's chat template.
        collator: your own ``rows -> batch`` function instead of ``PreferenceCollator``; rows are then not
            validated (your collator owns the format) and each row comes with its index under ``row_index``.
        train_split, val_split: the split to read when a source is a hub id, a dataset folder or a DatasetDict.
        seed: seeds the shuffling of training rows. The training loader is ChatDataModule's (``GroupedBatches``
            with one micro-batch per group): it shards rows by rank itself and resumes mid-epoch exactly.
        length_check_rows: at setup, this many rows of each split (spread evenly; ``None``: all) are tokenized
            to fail early, naming the row, when ``max_length`` would truncate a prompt away. Rows not checked
            raise the same error, with their index, when their batch is collated.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | str,
        train_data: DataSource,
        val_data: DataSource | None = None,
        *,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        max_length: int = 1024,
        chat_template: str | None = None,
        collator: Collator | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        length_check_rows: int | None = 1000,
    ) -> None:
        super().__init__(
            prepare_tokenizer(tokenizer, chat_template, require_chat_template=False),
            train_data,
            val_data,
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            max_length=max_length,
            train_split=train_split,
            val_split=val_split,
            num_workers=num_workers,
            shuffle=shuffle,
            seed=seed,
            length_check_rows=length_check_rows,
        )
        self.custom_collator = collator is not None
        self.collator: Collator = collator or PreferenceCollator(self.tokenizer, max_length=max_length)

    def _load(self, source: DataSource, split: str, name: str) -> Sequence[Mapping[str, Any]]:
        rows = load_rows(source, split=split, name=name)
        if not self.custom_collator:
            formats = validate_preference_rows(rows, name=name)
            if "conversational" in formats and not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(
                    f"{name} has conversational rows, but the tokenizer has no chat template. Pass one "
                    "with PreferenceDataModule(chat_template=...) (Hydra: data.chat_template=...), "
                    "e.g. lightning_gkd.data.tokenizer.CHATML_TEMPLATE."
                )
            check_rows_tokenize(
                rows,
                lambda row: truncated_pair(self.tokenizer, row, self.max_length),
                name=name,
                max_rows=self.length_check_rows,
            )
        return rows
