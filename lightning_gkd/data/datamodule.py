"""ChatDataModule: chat ``messages`` rows -> batches for GKD / SFT."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat_collator import ROW_INDEX, ChatMLCollator
from lightning_gkd.data.sources import DataSource, load_rows
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.data.validation import check_prompts_fit, validate_chat_rows

log = logging.getLogger(__name__)


class RowDataset(Dataset):
    """Index-access view over rows (a ``datasets.Dataset`` or a list of dicts); collation does the tokenizing.
    Each row comes with its index under ``row_index`` (the row itself is not modified), so errors can name it."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return {**self.rows[index], ROW_INDEX: index}


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase | str, chat_template: str | None = None
                      ) -> PreTrainedTokenizerBase:
    """Load the tokenizer if given by name, set ``chat_template`` if given, and fall back to EOS for padding."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"The tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has "
                         "no chat template. Pass one with ChatDataModule(chat_template=...) "
                         "(Hydra: data.chat_template=...), e.g. lightning_gkd.data.tokenizer.CHATML_TEMPLATE.")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
        rank_zero_warn(f"The tokenizer has no pad token; padding with EOS {tokenizer.eos_token!r}. Padding is "
                       "found by attention masks, never by id, so this is safe.")
    return tokenizer


class ChatDataModule(L.LightningDataModule):
    """Batches of chat conversations for distillation.

    Args:
        tokenizer: a tokenizer with a chat template (or a folder / hub id to load one from).
        train_data, val_data, test_data: a ``datasets.Dataset``, a list of ``{"messages": [...]}`` dicts, a local
            ``.json``/``.jsonl``/``.parquet`` file or dataset folder, or a hub dataset id. ``test_data`` is the
            held-out set that ``HeldOutEvaluation`` scores by generation before and after training.
        batch_size: rows per training batch (per device); ``val_batch_size`` defaults to it.
        max_length: conversations longer than this keep their last ``max_length`` tokens.
        chat_template: overrides the tokenizer's chat template.
        train_split, val_split, test_split: the split to read when a source is a hub id, a dataset folder or a
            DatasetDict.
        seed: seeds the shuffling of training rows.
        length_check_rows: at setup, this many rows of each split (spread evenly; ``None``: all) are tokenized
            to fail early, naming the row, when ``max_length`` would truncate a prompt away. Rows not checked
            raise the same error, with their index, when their batch is collated.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | str, train_data: DataSource,
                 val_data: DataSource | None = None, *, batch_size: int = 8, val_batch_size: int | None = None,
                 max_length: int = 1024, chat_template: str | None = None, train_split: str = "train",
                 val_split: str = "validation", test_data: DataSource | None = None, test_split: str = "test",
                 num_workers: int = 0, shuffle: bool = True, seed: int = 0,
                 length_check_rows: int | None = 1000) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}.")
        self.tokenizer = prepare_tokenizer(tokenizer, chat_template)
        self.train_source, self.val_source, self.test_source = train_data, val_data, test_data
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.max_length = max_length
        self.train_split, self.val_split, self.test_split = train_split, val_split, test_split
        self.num_workers, self.shuffle, self.seed = num_workers, shuffle, seed
        self.length_check_rows = length_check_rows
        self.collator = ChatMLCollator(self.tokenizer, max_length=max_length, name="train_data")
        self.val_collator = ChatMLCollator(self.tokenizer, max_length=max_length, name="val_data")
        self.train_rows: Sequence[Mapping[str, Any]] | None = None
        self.val_rows: Sequence[Mapping[str, Any]] | None = None
        self.test_rows: Sequence[Mapping[str, Any]] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is None:
            self.train_rows = self._load(self.train_source, self.train_split, "train_data")
        if self.val_rows is None and self.val_source is not None:
            self.val_rows = self._load(self.val_source, self.val_split, "val_data")
        if self.test_rows is None and self.test_source is not None:
            # held-out rows are generated from with the evaluator's own max_length, not collated with ours
            self.test_rows = self._load(self.test_source, self.test_split, "test_data", check_lengths=False)

    def _load(self, source: DataSource, split: str, name: str, *, check_lengths: bool = True
              ) -> Sequence[Mapping[str, Any]]:
        rows = load_rows(source, split=split, name=name)
        validate_chat_rows(rows, name=name)
        if check_lengths:
            check_prompts_fit(self.tokenizer, rows, max_length=self.max_length, name=name,
                              max_rows=self.length_check_rows)
        return rows

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(RowDataset(self.train_rows), batch_size=self.batch_size, shuffle=self.shuffle,
                          generator=generator, collate_fn=self.collator, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        if self.val_rows is None:
            return []
        return DataLoader(RowDataset(self.val_rows), batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=self.val_collator, num_workers=self.num_workers)
