"""ChatDataModule: chat ``messages`` rows -> batches for GKD / SFT."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import datasets
import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat_collator import ChatMLCollator
from lightning_gkd.data.formatting import FormattedRows, FormattingFuncSpec, resolve_formatting_func
from lightning_gkd.data.grouping import GroupedBatches, resolve_steps_per_generation, trainer_loader
from lightning_gkd.data.row_dataset import RowDataset, check_loader_settings
from lightning_gkd.data.sources import DataSource, load_rows
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.validation import check_prompts_fit, validate_chat_rows

log = logging.getLogger(__name__)


def prepare_tokenizer(
    tokenizer: PreTrainedTokenizerBase | str, chat_template: str | None = None, *, require_chat_template: bool = True
) -> PreTrainedTokenizerBase:
    """Load the tokenizer if given by name, set ``chat_template`` if given, and fall back to EOS for padding.
    ``require_chat_template=False`` (preference data, whose rows may be plain text) skips the template check."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if require_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has "
            "no chat template. Pass one with ChatDataModule(chat_template=...) "
            "(Hydra: data.chat_template=...), e.g. lightning_gkd.data.tokenizer.CHATML_TEMPLATE."
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


class ChatDataModule(L.LightningDataModule):
    """Batches of chat conversations for distillation.

    Args:
        tokenizer: a tokenizer with a chat template (or a folder / hub id to load one from).
        train_data, val_data, test_data: a ``datasets.Dataset``, a list of ``{"messages": [...]}`` dicts, a local
            ``.json``/``.jsonl``/``.parquet`` file or dataset folder, or a hub dataset id. ``test_data`` is the
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
            generation, see ``lightning_gkd.data.grouping``): the loader reads ``k * batch_size`` prompts at a time,
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
            to fail early, naming the row, when ``max_length`` would truncate a prompt away. Rows not checked
            raise the same error, with their index, when their batch is collated.
    """

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
    ) -> None:
        super().__init__()
        check_loader_settings(batch_size, max_length)
        self.steps_per_generation = resolve_steps_per_generation(
            batch_size, steps_per_generation, generation_batch_size
        )
        self.tokenizer = prepare_tokenizer(tokenizer, chat_template)
        self.train_source, self.val_source, self.test_source = train_data, val_data, test_data
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.max_length = max_length
        self.train_split, self.val_split, self.test_split = train_split, val_split, test_split
        self.num_workers, self.shuffle, self.seed = num_workers, shuffle, seed
        self.length_check_rows = length_check_rows
        self.formatting_func = resolve_formatting_func(formatting_func)
        #: Names of the validation sets when ``val_data`` is a dict; None for a single (unnamed) set.
        self.val_names: list[str] | None = _val_names(val_data)
        self.collator = ChatMLCollator(self.tokenizer, max_length=max_length, name="train_data")
        self.val_collator = ChatMLCollator(self.tokenizer, max_length=max_length, name="val_data")
        self.train_rows: Sequence[Mapping[str, Any]] | None = None
        self.val_rows: Sequence[Mapping[str, Any]] | None = None  # the only (or the first named) validation set
        self.val_sets: dict[str, Sequence[Mapping[str, Any]]] | None = None  # name -> rows, when named
        self.test_rows: Sequence[Mapping[str, Any]] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is None:
            self.train_rows = self._load(self.train_source, self.train_split, "train_data")
        if self.val_rows is None and self.val_source is not None:
            if self.val_names is None:
                self.val_rows = self._load(self.val_source, self.val_split, "val_data")
            else:
                named = cast(Mapping[str, DataSource], self.val_source)  # val_names is set only for a mapping
                self.val_sets = {
                    name: self._load(named[name], self.val_split, f"val_data[{name!r}]") for name in self.val_names
                }
                self.val_rows = self.val_sets[self.val_names[0]]
        if self.test_rows is None and self.test_source is not None:
            # held-out rows are generated from with the evaluator's own max_length, not collated with ours
            self.test_rows = self._load(self.test_source, self.test_split, "test_data", check_lengths=False)

    def _load(
        self, source: DataSource, split: str, name: str, *, check_lengths: bool = True
    ) -> Sequence[Mapping[str, Any]]:
        rows = load_rows(source, split=split, name=name)
        if self.formatting_func is not None:
            rows = FormattedRows(rows, self.formatting_func, name=name)
        validate_chat_rows(rows, name=name)
        if check_lengths:
            check_prompts_fit(
                self.tokenizer, rows, max_length=self.max_length, name=name, max_rows=self.length_check_rows
            )
        return rows

    def train_dataloader(self) -> GroupedBatches:
        self.setup("fit")
        assert self.train_rows is not None  # setup("fit") loaded them
        return trainer_loader(
            RowDataset(self.train_rows),
            self.collator,
            self.trainer,
            batch_size=self.batch_size,
            steps_per_generation=self.steps_per_generation,
            shuffle=self.shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        """One loader for a single validation set; a list of loaders, in ``val_names`` order, for named sets."""
        self.setup("validate")
        if self.val_rows is None:
            return []
        if self.val_sets is None:
            return self._val_loader(self.val_rows, self.val_collator)
        return [
            self._val_loader(
                rows, ChatMLCollator(self.tokenizer, max_length=self.max_length, name=f"val_data[{name!r}]")
            )
            for name, rows in self.val_sets.items()
        ]

    def _val_loader(self, rows: Sequence[Mapping[str, Any]], collator: ChatMLCollator) -> DataLoader:
        return DataLoader(
            RowDataset(rows),
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=collator,
            num_workers=self.num_workers,
        )


def _val_names(val_data: Any) -> list[str] | None:
    """The names of several validation sets (``val_data`` a plain dict of name -> source), else None."""
    if not isinstance(val_data, Mapping) or isinstance(val_data, (datasets.DatasetDict, datasets.Dataset)):
        return None
    if not val_data:
        raise ValueError("val_data is an empty dict; give {name: source, ...} with at least one set, or None.")
    bad = [name for name in val_data if not isinstance(name, str) or not name or "/" in name]
    if bad:
        raise ValueError(
            f"val_data names must be non-empty strings without '/' (they become metric names "
            f"val/<name>/loss), got {bad!r}."
        )
    return list(val_data)
