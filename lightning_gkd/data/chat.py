"""Chat-ML collation: messages -> left-padded ids with the prompt masked out of the labels."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat_tokens import (  # tokenize_chat, left_pad: also imported from here
    AssistantTurns,
    TokenizedChat,
    check_assistant_turns,
    left_pad,
    read_chat_template,
    render_chat,
    tokenize_chat,
)
from lightning_gkd.data.formatting import FormattingFuncSpec, chat_rows, resolve_formatting_func
from lightning_gkd.data.loader import resolve_steps_per_generation
from lightning_gkd.data.rows import ROW_INDEX, RowsDataModule
from lightning_gkd.data.sources import DataSource, load_rows
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.validation import (
    check_completions,
    check_prompt_truncation,
    rows_without_completion,
    validate_chat_rows,
)
from lightning_gkd.data.vision_chat import (
    VisionChatCollator,
    check_vision_options,
    check_vision_prompt_lengths,
    prepare_processor,
    processor_tokenizer,
)
from lightning_gkd.ops.constants import IGNORE_INDEX


class ChatMLCollator:
    """Collate rows with ``messages`` into a left-padded batch.

    Emits ``input_ids``, ``attention_mask``, ``labels`` (prompt and padding = -100) for the whole conversation,
    and ``prompts``, ``prompt_attention_mask`` for the prompt alone (what on-policy sampling continues: the
    conversation before its last assistant turn, whatever ``assistant_turns``).
    ``assistant_turns``: ``"last"`` labels the last assistant turn only; ``"all"`` labels every assistant turn
    (each one's content and end-of-turn tokens).
    ``truncate_prompts``: whether a conversation longer than ``max_length`` may lose the beginning of its prompt
    (``False``: ``ValueError``). True by default here, as the collator has always truncated (the held-out
    evaluator and the teacher-cache builder collate with it); ``ChatDataModule`` passes its own (default False).
    A row that cannot be used raises ``ValueError``, naming ``f"{name} row {row['row_index']}"`` when rows carry
    their index (ChatDataModule's do). ``columns``: row columns carried into the batch as lists of the rows'
    values (e.g. ``teacher`` for multi-teacher routing). ``carry_prompt_messages``: also ``prompt_messages``, per row
    the list of the messages ``prompts`` tokenizes (before the last assistant turn; whole, where ``prompts`` may have
    lost its beginning to ``max_length``), for a teacher that renders them with its own chat template.
    ``tools``: tool schemas the template renders into every conversation; with them (or ``first_turn_prompts``) the
    prompts end before the *first* assistant turn, where a multi-turn rollout starts (``lightning_gkd.rollouts``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int = 1024,
        *,
        name: str = "data",
        columns: Sequence[str] = (),
        assistant_turns: AssistantTurns = "last",
        truncate_prompts: bool = True,
        carry_prompt_messages: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        first_turn_prompts: bool = False,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer has no pad token; ChatDataModule sets it to EOS, or set one yourself.")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.name = name
        self.columns = list(columns)
        self.assistant_turns = check_assistant_turns(assistant_turns)
        self.truncate_prompts = truncate_prompts
        self.carry_prompt_messages = carry_prompt_messages
        self.tools = [dict(tool) for tool in tools] if tools else None
        self.first_turn_prompts = first_turn_prompts or bool(tools)

    def _prompt_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages a prompt renders: before the last assistant turn (a last assistant message is the
        completion), or before the first one (``first_turn_prompts``: where a rollout starts)."""
        if self.first_turn_prompts:
            first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
            return [dict(m) for m in messages[:first]]
        return [dict(m) for m in (messages[:-1] if messages[-1]["role"] == "assistant" else messages)]

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        chats = [self._tokenize(row) for row in rows]
        pad_id = self.tokenizer.pad_token_id
        full = [chat.ids for chat in chats]
        labels = [chat.labels() for chat in chats]
        prompts = [chat.prompt() for chat in chats]
        if self.first_turn_prompts:
            prompts = [
                self.tokenizer(
                    render_chat(self.tokenizer, self._prompt_messages(row["messages"]), True, self.tools),
                    add_special_tokens=False,
                )["input_ids"]
                for row in rows
            ]
        batch: dict[str, Any] = {
            "input_ids": left_pad(full, pad_id),
            "attention_mask": left_pad([[1] * len(ids) for ids in full], 0),
            "labels": left_pad(labels, IGNORE_INDEX),
            "prompts": left_pad(prompts, pad_id),
            "prompt_attention_mask": left_pad([[1] * len(ids) for ids in prompts], 0),
            **{column: [row.get(column) for row in rows] for column in self.columns},
        }
        if self.carry_prompt_messages:
            batch["prompt_messages"] = [self._prompt_messages(row["messages"]) for row in rows]
        return batch

    def _tokenize(self, row: Mapping[str, Any]) -> TokenizedChat:
        try:
            return tokenize_chat(
                self.tokenizer,
                row["messages"],
                self.max_length,
                assistant_turns=self.assistant_turns,
                truncate_prompts=self.truncate_prompts,
                tools=self.tools,
            )
        except ValueError as error:
            if ROW_INDEX in row:  # name the row: this may be hours into a run, on a row setup did not sample
                raise ValueError(f"{self.name} row {row[ROW_INDEX]}: {error}") from None
            raise


log = logging.getLogger(__name__)


def prepare_tokenizer(
    tokenizer: PreTrainedTokenizerBase | str, chat_template: str | None = None, *, require_chat_template: bool = True
) -> PreTrainedTokenizerBase:
    """Load the tokenizer if given by name, set ``chat_template`` if given (the Jinja text, or the path of a
    ``.jinja`` file holding it), and fall back to EOS for padding. ``require_chat_template=False`` (preference data,
    whose rows may be plain text) skips the template check."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    if require_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has "
            "no chat template. Pass one with ChatDataModule(chat_template=...), e.g. "
            "lightning_gkd.data.tokenizer.CHATML_TEMPLATE (Hydra: data.chat_template=<a .jinja file>)."
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
        rank_zero_warn(
            f"The tokenizer has no pad token; padding with EOS {tokenizer.eos_token!r}. Padding is "
            "found by attention masks, never by id, so this is safe."
        )
    return tokenizer


class ChatDataModule(RowsDataModule):
    """Batches of chat conversations for distillation.

    Args:
        tokenizer: a tokenizer with a chat template (or a folder / hub id to load one from).
        train_data, val_data, test_data: a ``datasets.Dataset``, a list of row dicts (see below), a local
            ``.jsonl``/``.json``/``.parquet``/``.arrow`` file (or ``.csv``/``.tsv`` of text columns, e.g. prompt
            and completion), a dataset folder, or a hub dataset id. ``test_data`` is the
            held-out set that ``HeldOutEvaluation`` scores by generation before and after training.
            ``val_data`` may also be a dict ``{name: source}`` of several validation sets: ``val_dataloader``
            then returns one loader per name (in order, listed in ``val_names``) and the modules log
            ``val/<name>/loss`` and ``val/<name>/<metric>`` instead of ``val/loss``.
        formatting_func: turns each raw row into a chat row before it is checked or collated: a function
            returning ``{"messages": [...]}``, ``{"prompt": ..., "completion": ...}`` (strings or message lists)
            or a list of messages; or the dotted path of such a function. Applied lazily each time a row is
            read (the data is not copied), to every split.
        batch_size: rows per training batch (per device); ``val_batch_size`` defaults to it.
        steps_per_generation: ``k``, the training micro-batches that share one sampling call (grouped
            generation, see ``lightning_gkd.data.loader``): the loader reads ``k * batch_size`` prompts at a time,
            an on-policy module samples completions for all of them at once, shuffles them and trains ``k``
            micro-batches (one optimizer or accumulation step each). Default 1.
        generation_batch_size: the same as ``k * batch_size``; set this or ``steps_per_generation``, not both.
        max_length: conversations longer than this keep their last ``max_length`` tokens.
        chat_template: overrides the tokenizer's chat template.
        train_split, val_split, test_split: the split to read when a source is a hub id, a dataset folder or a
            DatasetDict.
        seed: seeds the shuffling of training rows (epoch ``e`` is a permutation seeded by ``(seed, e)``).
            The training loader shards rows by rank itself (whole groups per rank) and is resumable: a run resumed
            from a mid-epoch checkpoint continues with the next micro-batch.
        length_check_rows: at setup, this many rows of each split (spread evenly; ``None``: all) are tokenized
            to fail early when ``max_length`` would cut into a prompt (see ``truncate_prompts``) or truncate one
            away. Rows not checked raise the same error, with their index, when their batch is collated.
        truncate_prompts: a conversation longer than ``max_length`` keeps its last ``max_length`` tokens, so its
            prompt loses its beginning. False (default): that is an error at setup (with the count of such rows,
            the first one and the ``max_length`` that fits them) or, for a row setup did not check, at collation.
            True: a warning with the count, and those rows train on their prompts' last tokens. A prompt truncated
            away entirely is an error either way.
        assistant_turns: ``"last"`` (default) trains on the last assistant turn of each conversation; ``"all"``
            on every assistant turn (each turn's content and end-of-turn tokens; TRL's assistant-only loss).
            Training batches only: validation batches label the last turn (the completion the generation metrics
            compare with), and on-policy steps sample a completion of the last turn's prompt (``prompts``), so
            with ``"all"`` only off-policy steps (dataset completions) train on the earlier turns.
        processor: a vision-language model's processor (``AutoProcessor``), or the folder / hub id to load it from:
            rows may then hold images (message contents as lists of ``{"type": "text"}`` and ``{"type": "image"}``
            parts, the images in the parts or in an ``images`` column; ``lightning_gkd.data.images``), and batches
            carry each row's image inputs (``vision``; ``lightning_gkd.data.vision_chat``). The processor renders
            and tokenizes (its tokenizer replaces ``tokenizer``; ``chat_template`` replaces its template). Prompts are
            never truncated (a prompt longer than ``max_length`` is an error at setup, with the count of such rows),
            ``assistant_turns`` must be ``"last"`` and ``truncate_prompts`` False. Without it, a row holding an image
            is an error at setup.

    Rows are ``{"messages": [...]}``; or, as TRL takes them, ``{"prompt": ..., "completion": ...}`` (strings:
    prompt -> a user turn, completion -> an assistant turn; or message lists) and prompt-only ``{"prompt": ...}``
    rows (for on-policy runs), converted lazily as they are read.
    """

    #: The rows it holds (matched against a method's ``data_format``: ``methods.base.check_data_format``).
    data_format = "chat"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | str,
        train_data: DataSource,
        val_data: DataSource | Mapping[str, DataSource] | None = None,
        *,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        max_length: int = 1024,
        chat_template: str | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        test_data: DataSource | None = None,
        test_split: str = "test",
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        length_check_rows: int | None = 1000,
        formatting_func: FormattingFuncSpec | None = None,
        steps_per_generation: int | None = None,
        generation_batch_size: int | None = None,
        truncate_prompts: bool = False,
        assistant_turns: AssistantTurns = "last",
        processor: Any = None,
    ) -> None:
        assistant_turns = check_assistant_turns(assistant_turns)
        #: the vision-language processor that collates rows with images (None: text rows, ``tokenizer``)
        self.processor = prepare_processor(processor, chat_template)
        if self.processor is not None:
            check_vision_options(assistant_turns=assistant_turns, truncate_prompts=truncate_prompts)
            tokenizer = processor_tokenizer(self.processor)
        super().__init__(
            prepare_tokenizer(
                tokenizer,
                chat_template if self.processor is None else None,
                require_chat_template=self.processor is None,
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
        self.steps_per_generation = resolve_steps_per_generation(
            batch_size, steps_per_generation, generation_batch_size
        )
        self.test_source, self.test_split = test_data, test_split
        self.assistant_turns, self.truncate_prompts = assistant_turns, truncate_prompts
        self.formatting_func = resolve_formatting_func(formatting_func)
        #: Row columns the collators carry into batches (``carry_columns``); ``carry_prompt_messages``.
        self.columns: list[str] = []
        self.carries_prompt_messages = False
        self.tools: list[dict[str, Any]] | None = None  # rendered by the chat template (``use_rollouts``)
        self.first_turn_prompts = False
        self.collator: ChatMLCollator | VisionChatCollator
        if self.processor is not None:
            self.collator = VisionChatCollator(self.processor, max_length=max_length, name="train_data")
        else:
            self.collator = ChatMLCollator(
                self.tokenizer,
                max_length=max_length,
                name="train_data",
                assistant_turns=assistant_turns,
                truncate_prompts=truncate_prompts,
            )
        self.val_collator = self._val_collator("val_data")
        self.test_rows: Sequence[Mapping[str, Any]] | None = None

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.test_rows is None and self.test_source is not None:
            # held-out rows are generated from with the evaluator's own max_length, not collated with ours
            self.test_rows = self._load(self.test_source, self.test_split, "test_data", check_lengths=False)

    def check_completions(self, reason: str | None) -> None:
        """The checks a method's use of dataset completions needs (after ``setup``): with a ``reason`` (why the
        method trains on them), every training row must end with an assistant turn; validation rows without one
        get a warning (the validation loss and generation metrics score dataset completions)."""
        if reason is not None:
            check_completions(self.train_rows or [], name="train_data", reason=reason)
        val_sets = self.val_sets or ({"": self.val_rows} if self.val_rows is not None else {})
        for set_name, rows in val_sets.items():
            missing = rows_without_completion(rows)
            if missing:
                where = f"val_data[{set_name!r}]" if set_name else "val_data"
                rank_zero_warn(
                    f"{where}: {len(missing)} of {len(rows)} rows (first: row {missing[0]}) end "
                    "without an assistant turn; the validation loss and the generation metrics score "
                    "dataset completions, so those rows count for nothing there."
                )

    def carry_columns(self, columns: Sequence[str]) -> None:
        """Carry these row columns into every batch (lists of the rows' string values), after checking that every
        training and validation row has one (``ValueError`` naming the first row without). A method that routes
        rows by a column (``GKDModule`` with ``teacher.kind=multi``) calls it."""
        self.setup("fit")
        sets = {
            "train_data": self.train_rows or [],
            **{f"val_data[{k!r}]": v for k, v in (self.val_sets or {}).items()},
        }
        if self.val_sets is None and self.val_rows is not None:
            sets["val_data"] = self.val_rows
        for column in columns:
            for where, rows in sets.items():
                missing = next((i for i, row in enumerate(rows) if not isinstance(row.get(column), str)), None)
                if missing is not None:
                    raise ValueError(
                        f"{where} row {missing} has no string {column!r} column (got {rows[missing].get(column)!r}); "
                        f"every row needs one to be routed to its teacher."
                    )
        self.columns = list(dict.fromkeys([*self.columns, *columns]))
        for collator in (self.collator, self.val_collator):
            collator.columns = list(self.columns)

    def carry_prompt_messages(self) -> None:
        """Carry each row's prompt messages into every batch (``prompt_messages``, see ``ChatMLCollator``): a
        teacher with another tokenizer renders them with its own chat template."""
        self.carries_prompt_messages = True
        for collator in (self.collator, self.val_collator):
            collator.carry_prompt_messages = True

    def use_rollouts(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        """Prepare batches for multi-turn rollouts (a method with tools or an environment calls it): the chat
        template renders ``tools`` (JSON schemas) in every conversation, prompts end before the first assistant
        turn (where the student starts acting) and carry their messages (``prompt_messages``)."""
        if self.processor is not None:
            raise ValueError(
                "Multi-turn rollouts (tools, environments) do not take rows with images yet: train a vision-language "
                "student without method.rollout, or a text student with them."
            )
        self.tools = [dict(tool) for tool in tools] if tools else None
        self.first_turn_prompts = True
        self.carry_prompt_messages()
        for collator in (self.collator, self.val_collator):
            if isinstance(collator, ChatMLCollator):
                collator.tools, collator.first_turn_prompts = self.tools, True

    def _load(
        self, source: DataSource, split: str, name: str, *, check_lengths: bool = True
    ) -> Sequence[Mapping[str, Any]]:
        rows = chat_rows(load_rows(source, split=split, name=name), self.formatting_func, name=name)
        validate_chat_rows(rows, name=name, images_allowed=self.processor is not None)
        if check_lengths and isinstance(self.collator, VisionChatCollator):
            check_vision_prompt_lengths(
                rows, self.collator.lengths, name=name, max_length=self.max_length, max_rows=self.length_check_rows
            )
        elif check_lengths:
            check_prompt_truncation(
                rows,
                self._untruncated_lengths,
                name=name,
                max_length=self.max_length,
                truncate_prompts=self.truncate_prompts,
                max_rows=self.length_check_rows,
            )
        return rows

    def _untruncated_lengths(self, row: Mapping[str, Any]) -> tuple[int, int]:
        chat = tokenize_chat(self.tokenizer, row["messages"], sys.maxsize)
        return chat.num_prompt_tokens, len(chat.ids) - chat.num_prompt_tokens

    def _val_collator(self, name: str) -> ChatMLCollator | VisionChatCollator:
        # the last assistant turn whatever assistant_turns: the generation metrics take it as the reference
        if self.processor is not None:
            return VisionChatCollator(
                self.processor,
                max_length=self.max_length,
                name=name,
                columns=self.columns,
                carry_prompt_messages=self.carries_prompt_messages,
            )
        return ChatMLCollator(
            self.tokenizer,
            max_length=self.max_length,
            name=name,
            columns=self.columns,
            truncate_prompts=self.truncate_prompts,
            carry_prompt_messages=self.carries_prompt_messages,
            tools=self.tools,
            first_turn_prompts=self.first_turn_prompts,
        )

    def val_collator_for(self, name: str | None) -> ChatMLCollator | VisionChatCollator:
        return self.val_collator if name is None else self._val_collator(f"val_data[{name!r}]")
