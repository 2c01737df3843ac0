"""Preference collation: (prompt, chosen, rejected) rows -> one left-padded batch [chosen rows; rejected rows].

With a vision-language model's processor (``PreferenceDataModule(processor=...)``) a conversational prompt may hold
images (image parts of its messages, or TRL's ``images`` column): ``VisionPreferenceCollator`` renders the prompt
through the processor with the row's images and each completion through its tokenizer (as
``data.vision_chat.tokenize_vision_chat`` does), and the batch also carries ``vision``, one dict of image tensors per
sequence (a pair's prompt images twice: for its chosen and for its rejected row). Prompts are then never truncated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat import prepare_tokenizer
from lightning_gkd.data.chat_tokens import left_pad, tokenize_chat
from lightning_gkd.data.preference_validation import REF_FIELDS, pair_format, validate_preference_rows
from lightning_gkd.data.rows import ROW_INDEX, RowsDataModule
from lightning_gkd.data.sources import DataSource, load_rows
from lightning_gkd.data.validation import (
    check_prompt_truncation,
    check_rows_tokenize,
    prompt_cut,
    prompt_start,
    whole_prompt_truncated,
)
from lightning_gkd.data.vision_chat import (
    ProcessorCollator,
    check_vision_prompt_lengths,
    prepare_processor,
    processor_tokenizer,
    render,
    tokenize_vision_chat,
)
from lightning_gkd.ops.constants import IGNORE_INDEX

#: How a pair longer than ``max_length`` is cut: ``keep_start`` (TRL 1.16's default) keeps the first tokens of
#: prompt + completion, ``keep_end`` the last.
TRUNCATION_MODES = ("keep_start", "keep_end")


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
        if rejected.ids[: rejected.num_prompt_tokens] != prompt:  # only a template that renders the answer back
            raise ValueError(
                "The chat template renders the prompt's messages differently before the chosen and the rejected "
                "answer, so the pair has no common prompt; use a template that renders earlier turns independently "
                "of the last one."
            )
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


def check_truncation_mode(truncation_mode: str) -> None:
    """ValueError unless ``truncation_mode`` is one of ``TRUNCATION_MODES``."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}: keep_start (TRL's default) "
            "keeps the first max_length tokens of prompt + completion, keep_end the last."
        )


def truncate(
    prompt: list[int], completion: list[int], max_length: int, truncation_mode: str = "keep_start"
) -> tuple[list[int], list[int]]:
    """Prompt + completion cut to ``max_length`` tokens as TRL 1.16 cuts them: ``keep_start`` keeps the first tokens
    (the completion loses its end), ``keep_end`` the last (the prompt loses its beginning). ``ValueError`` when no
    completion token (``keep_start``) or no prompt token (``keep_end``) would remain."""
    check_truncation_mode(truncation_mode)
    overflow = len(prompt) + len(completion) - max_length
    if overflow <= 0:
        return prompt, completion
    if truncation_mode == "keep_start":
        if len(prompt) >= max_length:
            raise ValueError(
                f"max_length={max_length} leaves no completion token: the prompt alone has {len(prompt)} tokens and "
                "truncation_mode=keep_start keeps the first max_length tokens."
            )
        return prompt, completion[: max_length - len(prompt)]
    if overflow >= len(prompt):
        raise ValueError(whole_prompt_truncated(max_length, len(completion)))
    return prompt[overflow:], completion


def truncated_pair(
    tokenizer: PreTrainedTokenizerBase,
    row: Mapping[str, Any],
    max_length: int,
    truncation_mode: str = "keep_start",
    truncate_prompts: bool = False,
) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """``((prompt, chosen), (prompt, rejected))`` token ids of a validated row, each side cut by ``truncate``.

    ``ValueError`` (saying which ``max_length`` fits) when a side would keep no completion token (``keep_start``)
    or no prompt token (``keep_end``), or, unless ``truncate_prompts``, when ``keep_end`` would cut the beginning
    off the prompt.
    """
    pair = tokenize_pair(tokenizer, row)
    longest = max(len(pair.chosen), len(pair.rejected))
    fits = len(pair.prompt) + longest
    if fits > max_length:
        start = prompt_start(row)
        if truncation_mode == "keep_start" and len(pair.prompt) >= max_length:
            raise ValueError(
                f"max_length={max_length} leaves no completion token: the prompt alone has {len(pair.prompt)} tokens "
                "and truncation_mode=keep_start keeps the first max_length tokens (TRL drops such rows). "
                f"max_length={fits} keeps this pair whole, {len(pair.prompt) + 1} at least one completion token: "
                "raise max_length (Hydra: data.max_length), shorten or drop the row, or set "
                f"truncation_mode=keep_end (Hydra: data.truncation_mode=keep_end). Prompt starts {start!r}."
            )
        if truncation_mode == "keep_end":
            if longest >= max_length:
                raise ValueError(f"{whole_prompt_truncated(max_length, longest)} Prompt starts {start!r}.")
            if not truncate_prompts:
                raise ValueError(prompt_cut(max_length, len(pair.prompt), longest, start))
    return (
        truncate(pair.prompt, pair.chosen, max_length, truncation_mode),
        truncate(pair.prompt, pair.rejected, max_length, truncation_mode),
    )


class PreferenceCollator:
    """Collate preference rows into one batch whose first half is prompt+chosen and second half prompt+rejected.

    For ``B`` rows it emits ``input_ids``, ``attention_mask`` and ``labels`` (prompt and padding = -100) of shape
    ``(2B, L)``, all left-padded to one length so a single forward covers both halves; ``prompts`` and
    ``prompt_attention_mask`` ``(B, P)`` for generation; ``index`` ``(B,)`` when rows carry ``row_index``; and
    ``ref_chosen_logps``/``ref_rejected_logps`` ``(B,)`` when every row carries them (precomputed reference).
    Sequences longer than ``max_length`` are cut as TRL 1.16 cuts them (``truncated_pair``): ``keep_start`` (default)
    keeps their first ``max_length`` tokens, ``keep_end`` their last; with ``keep_end`` a prompt that would lose its
    beginning is a ``ValueError`` unless ``truncate_prompts``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int = 1024,
        truncation_mode: str = "keep_start",
        truncate_prompts: bool = False,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The tokenizer has no pad token; PreferenceDataModule sets it to EOS, or set one yourself."
            )
        check_truncation_mode(truncation_mode)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.truncate_prompts = truncate_prompts

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        chosen, rejected = [], []
        for row in rows:
            try:
                pair = truncated_pair(self.tokenizer, row, self.max_length, self.truncation_mode, self.truncate_prompts)
            except ValueError as error:
                if ROW_INDEX in row:  # name the row: this may be hours into a run
                    raise ValueError(f"row {row[ROW_INDEX]}: {error}") from None
                raise
            chosen.append(pair[0])
            rejected.append(pair[1])
        return pair_batch(rows, chosen, rejected, self.tokenizer.pad_token_id)


def pair_batch(
    rows: Sequence[Mapping[str, Any]],
    chosen: Sequence[tuple[list[int], list[int]]],
    rejected: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
) -> dict[str, Any]:
    """The batch of ``PreferenceCollator`` from each row's ``(prompt, chosen)`` and ``(prompt, rejected)`` ids."""
    sequences = [*chosen, *rejected]
    full = [prompt + completion for prompt, completion in sequences]
    labels = [[IGNORE_INDEX] * len(prompt) + completion for prompt, completion in sequences]
    prompts = [prompt for prompt, _ in chosen]
    batch: dict[str, Any] = {
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


@dataclass(frozen=True)
class VisionPair:
    """One preference pair for a vision-language model: prompt ids (image tokens expanded), the two completions
    (cut to fit ``max_length`` after the prompt), and the prompt's image inputs (empty without images)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    images: dict[str, torch.Tensor]


def tokenize_vision_pair(processor: Any, row: Mapping[str, Any], max_length: int) -> VisionPair:
    """A validated row through ``processor``: a conversational prompt with the row's images through the processor
    and each completion (the rest of the rendered conversation) through its tokenizer, as ``tokenize_vision_chat``
    does; plain-text and pre-tokenized rows as ``tokenize_pair`` reads them (no images). The prompt is never cut:
    ValueError when it leaves no completion token within ``max_length``; a completion that does not fit is cut at
    its end."""
    tokenizer = processor_tokenizer(processor)
    if pair_format(row) != "conversational":
        pair = tokenize_pair(tokenizer, row)
        prompt, chosen, rejected, images = pair.prompt, pair.chosen, pair.rejected, {}
    else:
        messages = [dict(message) for message in row["prompt"]]
        chat = tokenize_vision_chat(
            processor, {"messages": [*messages, *row["chosen"]], "images": row.get("images")}, sys.maxsize
        )
        prompt_text = render(processor, messages, add_generation_prompt=True)
        rejected_text = render(processor, [*messages, *row["rejected"]], add_generation_prompt=False)
        if not rejected_text.startswith(prompt_text):
            raise ValueError(
                "the chat template renders the prompt otherwise than the start of the rejected conversation; with "
                "images the prompt and completion are split on the text, so use a template whose prompt prefixes "
                "the conversation."
            )
        prompt, chosen, images = chat.prompt_ids, chat.completion_ids, chat.images
        rejected = tokenizer(rejected_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
    if len(prompt) >= max_length:
        raise ValueError(
            f"its prompt is {len(prompt)} tokens (image tokens included) and max_length={max_length} leaves no "
            f"completion token; an image's tokens are never cut: raise max_length to at least {len(prompt) + 1} "
            "(Hydra: data.max_length), use smaller images, or drop the row."
        )
    room = max_length - len(prompt)
    return VisionPair(list(prompt), list(chosen[:room]), list(rejected[:room]), images)


class VisionPreferenceCollator(ProcessorCollator):
    """Collate preference rows whose prompts may hold images into ``PreferenceCollator``'s batch plus ``vision``:
    one dict of image tensors per sequence, in the order of ``input_ids`` (each pair's prompt images for its chosen
    row, then again for its rejected row). Prompts are never truncated (``tokenize_vision_pair``); a row that cannot
    be used raises ``ValueError`` naming it (``name`` and its index)."""

    def __init__(self, processor: Any, max_length: int = 1024, *, name: str = "train_data") -> None:
        super().__init__(processor, max_length, name=name)

    def tokenize(self, row: Mapping[str, Any]) -> VisionPair:
        return self.named(row, tokenize_vision_pair)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        pairs = [self.tokenize(row) for row in rows]
        batch = pair_batch(
            rows,
            [(pair.prompt, pair.chosen) for pair in pairs],
            [(pair.prompt, pair.rejected) for pair in pairs],
            self.tokenizer.pad_token_id,
        )
        batch["vision"] = [dict(pair.images) for pair in [*pairs, *pairs]]
        return batch

    def lengths(self, row: Mapping[str, Any]) -> tuple[int, int]:
        """The row's ``(prompt tokens, longer completion's tokens)``, uncut. ValueError (``tokenize_vision_pair``'s)
        when the prompt is exactly ``max_length`` tokens; a longer one is counted by ``check_vision_prompt_lengths``."""
        pair = tokenize_vision_pair(self.processor, row, sys.maxsize)
        if len(pair.prompt) == self.max_length:
            tokenize_vision_pair(self.processor, row, self.max_length)  # raises, naming the max_length that fits
        return len(pair.prompt), max(len(pair.chosen), len(pair.rejected))


def check_vision_preference_options(*, truncation_mode: str, truncate_prompts: bool) -> None:
    """The truncation options pairs collated by a processor do not take: their prompts are never cut."""
    if truncation_mode != "keep_start" or truncate_prompts:
        raise ValueError(
            f"truncation_mode={truncation_mode!r}, truncate_prompts={truncate_prompts} would cut prompts, and with a "
            "processor (prompts with images) prompts are never truncated: a completion that does not fit is cut at "
            "its end. Use truncation_mode='keep_start' and truncate_prompts=False (Hydra: data.truncation_mode="
            "keep_start data.truncate_prompts=false) with a max_length that fits."
        )


Collator = Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]


class PreferenceDataModule(RowsDataModule):
    """Batches of preference pairs for ``DPOModule``.

    Args:
        tokenizer: a tokenizer (or a folder / hub id to load one from); conversational rows need a chat template.
        train_data, val_data: a ``datasets.Dataset``, a list of dicts, a local ``.json``/``.jsonl``/``.parquet``
            file or dataset folder, or a hub dataset id. ``val_data`` may also be a dict ``{name: source}`` of
            several validation sets: one loader each (in order, listed in ``val_names``), and ``DPOModule`` logs
            ``val/<name>/loss``, ``val/<name>/rewards/accuracies``, ... per set. Rows hold ``prompt``,
            ``chosen``, ``rejected`` as plain strings or as message lists (``prompt``: the conversation so far;
            ``chosen``/``rejected``: one assistant message each), or pre-tokenized ``prompt_input_ids``/
            ``chosen_input_ids``/``rejected_input_ids`` (used untouched). Optional ``ref_chosen_logps``/
            ``ref_rejected_logps``: reference log-probs computed elsewhere.
        batch_size: pairs per training batch (the model sees ``2 * batch_size`` sequences); ``val_batch_size``
            defaults to it.
        max_length: prompt + completion longer than this is cut to ``max_length`` tokens, by ``truncation_mode``.
        truncation_mode: ``"keep_start"`` (TRL 1.16's default): keep the first ``max_length`` tokens, so the prompt
            stays whole and the completion loses its end; a prompt of ``max_length`` tokens or more is a
            ``ValueError`` naming the row and the ``max_length`` that fits (TRL drops such rows silently).
            ``"keep_end"``: keep the last ``max_length`` tokens, so the prompt loses its beginning: a
            ``ValueError`` naming the row unless ``truncate_prompts`` (then a warning with the count).
        truncate_prompts: with ``keep_end``, train on prompts whose beginning is cut instead of failing.
        chat_template: overrides the tokenizer's chat template.
        collator: your own ``rows -> batch`` function instead of ``PreferenceCollator``; rows are then not
            validated (your collator owns the format) and each row comes with its index under ``row_index``.
        train_split, val_split: the split to read when a source is a hub id, a dataset folder or a DatasetDict.
        seed: seeds the shuffling of training rows. The training loader is ChatDataModule's (``GroupedBatches``
            with one micro-batch per group): it shards rows by rank itself and resumes mid-epoch exactly.
        length_check_rows: at setup, this many rows of each split (spread evenly; ``None``: all) are tokenized
            to fail early, naming the row, when ``max_length`` would cut a pair as described above. Rows not
            checked raise the same error, with their index, when their batch is collated.
        processor: a vision-language model's processor (``AutoProcessor``), or the folder / hub id to load it from:
            conversational prompts may then hold images (``{"type": "image", ...}`` parts of their messages, or
            TRL's ``images`` column with one entry per image part without one; ``data.images``), and batches carry
            each sequence's image inputs (``vision``; see ``VisionPreferenceCollator``). The processor renders the
            prompt with its chat template (``chat_template`` replaces the processor's) and its tokenizer replaces
            ``tokenizer``. Prompts are never truncated: one that leaves no completion token within ``max_length``
            is refused at setup with the ``max_length`` that fits, so ``truncation_mode="keep_end"`` and
            ``truncate_prompts`` are refused; a completion that does not fit is cut at its end.
    """

    #: The rows it holds (matched against a method's ``data_format``: ``methods.base.check_data_format``).
    data_format = "preference"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | str,
        train_data: DataSource,
        val_data: DataSource | Mapping[str, DataSource] | None = None,
        *,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        max_length: int = 1024,
        truncation_mode: str = "keep_start",
        truncate_prompts: bool = False,
        chat_template: str | None = None,
        collator: Collator | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        length_check_rows: int | None = 1000,
        processor: Any = None,
    ) -> None:
        #: the vision-language processor that collates pairs whose prompts hold images (None: ``tokenizer`` alone)
        self.processor = prepare_processor(processor, chat_template)
        if self.processor is not None:
            check_vision_preference_options(truncation_mode=truncation_mode, truncate_prompts=truncate_prompts)
            tokenizer = processor_tokenizer(self.processor)
        super().__init__(
            prepare_tokenizer(
                tokenizer, chat_template if self.processor is None else None, require_chat_template=False
            ),
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
        check_truncation_mode(truncation_mode)
        self.truncation_mode, self.truncate_prompts = truncation_mode, truncate_prompts
        self.custom_collator = collator is not None
        self.collator: Collator
        if collator is not None:
            self.collator = collator
        elif self.processor is not None:
            self.collator = VisionPreferenceCollator(self.processor, max_length=max_length, name="train_data")
        else:
            self.collator = PreferenceCollator(
                self.tokenizer,
                max_length=max_length,
                truncation_mode=truncation_mode,
                truncate_prompts=truncate_prompts,
            )

    def _load(self, source: DataSource, split: str, name: str) -> Sequence[Mapping[str, Any]]:
        rows = load_rows(source, split=split, name=name)
        if not self.custom_collator:
            formats = validate_preference_rows(rows, name=name, images_allowed=self.processor is not None)
            renderer = self.tokenizer if self.processor is None else self.processor
            if "conversational" in formats and not getattr(renderer, "chat_template", None):
                owner = "tokenizer" if self.processor is None else "processor"
                raise ValueError(
                    f"{name} has conversational rows, but the {owner} has no chat template. Pass one "
                    "with PreferenceDataModule(chat_template=...) (Hydra: data.chat_template=...), "
                    "e.g. lightning_gkd.data.tokenizer.CHATML_TEMPLATE."
                )
            self._check_lengths(rows, name)
        return rows

    def val_collator_for(self, name: str | None) -> Collator:
        """The training collator, or with a processor one that names the validation set in its errors."""
        if self.custom_collator or self.processor is None:
            return self.collator
        where = "val_data" if name is None else f"val_data[{name!r}]"
        return VisionPreferenceCollator(self.processor, max_length=self.max_length, name=where)

    def _check_lengths(self, rows: Sequence[Mapping[str, Any]], name: str) -> None:
        if isinstance(self.collator, VisionPreferenceCollator):  # prompts are never cut; long completions are
            check_vision_prompt_lengths(
                rows, self.collator.lengths, name=name, max_length=self.max_length, max_rows=self.length_check_rows
            )
            return
        if self.truncation_mode == "keep_start":  # the prompt stays whole; only a prompt filling max_length fails
            check_rows_tokenize(
                rows,
                lambda row: truncated_pair(self.tokenizer, row, self.max_length, "keep_start"),
                name=name,
                max_rows=self.length_check_rows,
            )
            return

        def lengths(row: Mapping[str, Any]) -> tuple[int, int]:
            pair = tokenize_pair(self.tokenizer, row)
            return len(pair.prompt), max(len(pair.chosen), len(pair.rejected))  # the longer side cuts more

        check_prompt_truncation(
            rows,
            lengths,
            name=name,
            max_length=self.max_length,
            truncate_prompts=self.truncate_prompts,
            max_rows=self.length_check_rows,
        )
