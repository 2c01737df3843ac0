"""PreferenceDataModule: (prompt, chosen, rejected) rows -> batches for DPO."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.datamodule import prepare_tokenizer
from lightning_gkd.data.grouping import GroupedBatches, trainer_loader
from lightning_gkd.data.preference_collator import PreferenceCollator, check_pairs_fit
from lightning_gkd.data.preference_validation import validate_preference_rows
from lightning_gkd.data.row_dataset import RowDataset, check_loader_settings
from lightning_gkd.data.sources import DataSource, load_rows

Collator = Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]


class PreferenceDataModule(L.LightningDataModule):
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
        super().__init__()
        check_loader_settings(batch_size, max_length)
        self.tokenizer = prepare_tokenizer(tokenizer, chat_template, require_chat_template=False)
        self.train_source, self.val_source = train_data, val_data
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.max_length = max_length
        self.train_split, self.val_split = train_split, val_split
        self.num_workers, self.shuffle, self.seed = num_workers, shuffle, seed
        self.length_check_rows = length_check_rows
        self.custom_collator = collator is not None
        self.collator: Collator = collator or PreferenceCollator(self.tokenizer, max_length=max_length)
        self.train_rows: Sequence[Mapping[str, Any]] | None = None
        self.val_rows: Sequence[Mapping[str, Any]] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is None:
            self.train_rows = self._load(self.train_source, self.train_split, "train_data")
        if self.val_rows is None and self.val_source is not None:
            self.val_rows = self._load(self.val_source, self.val_split, "val_data")

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
            check_pairs_fit(
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
            shuffle=self.shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        if self.val_rows is None:
            return []
        return DataLoader(
            RowDataset(self.val_rows),
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=self.collator,
            num_workers=self.num_workers,
        )
