"""The CausalLMModule contract: a method refuses a datamodule holding the other kind of rows, with a plain Trainer."""

import copy

import lightning as L
import pytest

from lightning_gkd import ChatDataModule, DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.data.toy.preference import addition_preference_rows
from lightning_gkd.methods.base import check_data_format


def _trainer(tmp_path):
    return L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def test_gkd_refuses_preference_pairs_and_dpo_refuses_chat_rows_before_a_step(
    tmp_path, tokenizer, student, teacher, toy_rows
):
    pairs = PreferenceDataModule(tokenizer, addition_preference_rows("train", 8), batch_size=2)
    gkd = GKDModule(student, teacher, tokenizer, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"GKDModule trains on chat rows .* holds preference pairs"):
        _trainer(tmp_path).fit(gkd, datamodule=pairs)
    assert gkd.global_step == 0
    dpo = DPOModule(student, tokenizer, reference=copy.deepcopy(student))
    with pytest.raises(ValueError, match=r"DPOModule trains on preference pairs .* holds chat rows"):
        _trainer(tmp_path).fit(dpo, datamodule=ChatDataModule(tokenizer, toy_rows["train"], batch_size=2))


def test_datamodules_that_declare_no_format_and_matching_ones_pass(tokenizer, toy_rows):
    chat = ChatDataModule(tokenizer, toy_rows["train"])
    check_data_format(GKDModule, chat)
    check_data_format(GKDModule, L.LightningDataModule())  # a user's own datamodule: not checked
    check_data_format(DPOModule, PreferenceDataModule(tokenizer, addition_preference_rows("train", 4)))
