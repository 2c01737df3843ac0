"""Grouped generation: one sampling call per group of k micro-batches, each an optimizer step; every prompt once
per epoch; ranks get distinct whole groups; a mid-group resume repeats an uninterrupted run exactly."""

from collections import Counter
from functools import partial

import pytest
import torch
from helpers.fitting import logged, small_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.loader import (
    GENERATION_GROUP,
    GROUP_STEP,
    GroupedBatches,
    rank_groups,
    resolve_steps_per_generation,
    select_rows,
)
from lightning_gkd.data.rows import RowDataset
from lightning_gkd.toy import addition_rows


class RecordingGKD(GKDModule):
    """Records, per training step, the prompt token ids it trained on and the sampling seed of each call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_rows: list[tuple[int, ...]] = []
        self.steps_seen: list[int] = []

    def training_batch(self, batch, batch_idx):
        self.steps_seen.append(self.global_step)
        source, trained = super().training_batch(batch, batch_idx)
        for ids, mask in zip(trained["prompts"], trained["prompt_attention_mask"], strict=True):
            self.trained_rows.append(tuple(ids[mask.bool()].tolist()))
        return source, trained


def test_setting_both_or_a_batch_that_does_not_divide_is_an_error():
    with pytest.raises(ValueError, match="not both"):
        resolve_steps_per_generation(8, 2, 16)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        resolve_steps_per_generation(8, None, 20)
    with pytest.raises(ValueError, match=">= 1"):
        resolve_steps_per_generation(8, 0, None)
    assert resolve_steps_per_generation(8, None, 32) == 4
    assert resolve_steps_per_generation(8, None, None) == 1


def test_ranks_get_distinct_whole_groups_and_every_row_once():
    rows = 100
    per_rank = [rank_groups(rows, group_size=12, epoch=3, seed=7, shuffle=True, rank=r, world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])  # same number of groups, so the same number of steps
    assert [len(g) for g in per_rank[0]] == [12, 12, 12, 12, 2]  # 4 full groups, then 4 leftover rows shared
    seen = [i for groups in per_rank for group in groups for i in group]
    assert len(seen) == len(set(seen)) == 100
    again = rank_groups(rows, group_size=12, epoch=3, seed=7, shuffle=True, rank=0, world_size=2)
    assert again == per_rank[0]
    assert rank_groups(rows, group_size=12, epoch=4, seed=7, shuffle=True, rank=0, world_size=2) != again


def test_loader_yields_k_micro_batches_per_group_cut_from_one_collated_group(tokenizer):
    rows = addition_rows("train", 24)
    loader = GroupedBatches(
        RowDataset(rows), ChatMLCollator(tokenizer, 64), batch_size=4, steps_per_generation=3, seed=1
    )
    items = list(loader)
    assert len(items) == len(loader) == 6
    assert [item[GROUP_STEP] for item in items] == [0, 1, 2, 0, 1, 2]
    first = items[0]
    group = first[GENERATION_GROUP]
    assert group["prompts"].shape[0] == 12
    for step, item in enumerate(items[:3]):
        expected = select_rows(group, list(range(4 * step, 4 * step + 4)))
        assert torch.equal(item["input_ids"], expected["input_ids"])
        # trimmed: no column is padding in every row of the micro-batch
        assert bool(item["attention_mask"][:, 0].any())


def test_k4_eight_optimizer_steps_make_two_sampling_calls_and_use_each_prompt_once(
    student, teacher, tokenizer, tmp_path
):
    rows = addition_rows("train", 32)
    module = RecordingGKD(student, teacher, tokenizer, lmbda=1.0)
    calls = []
    original = module.sample_batch
    module.sample_batch = lambda model, batch, seed: (
        calls.append(batch["prompts"].shape[0]),
        original(model, batch, seed),
    )[1]
    datamodule = ChatDataModule(tokenizer, rows, batch_size=4, max_length=64, steps_per_generation=4)
    trainer = small_trainer(tmp_path, csv=True, max_steps=8)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 8  # optimizer steps, not groups
    assert calls == [16, 16]  # one call per group of 4 x 4 prompts
    assert module.steps_seen == list(range(8))
    # each of the 32 prompts trained on exactly once in the epoch
    collator = ChatMLCollator(tokenizer, 64)
    all_prompts = collator(rows)
    expected = Counter(
        tuple(ids[mask.bool()].tolist())
        for ids, mask in zip(all_prompts["prompts"], all_prompts["prompt_attention_mask"], strict=True)
    )
    assert Counter(module.trained_rows) == expected


def test_grouped_generation_with_gradient_accumulation(student, teacher, tokenizer, tmp_path):
    module = RecordingGKD(student, teacher, tokenizer, lmbda=1.0)
    datamodule = ChatDataModule(
        tokenizer, addition_rows("train", 32), batch_size=4, max_length=64, generation_batch_size=16
    )
    trainer = small_trainer(tmp_path, csv=True, max_steps=4, accumulate_grad_batches=2)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 4
    assert module.sampling_calls == 2  # 8 micro-batches = 2 groups of 4
    assert len(module.trained_rows) == 32


def _run(student, teacher, tokenizer, tmp_path, *, max_steps, ckpt_path=None, every=None):
    module = GKDModule(
        student,
        teacher,
        tokenizer,
        lmbda=0.5,
        sampling={"max_new_tokens": 5},
        training={"seed": 3, "optimizer": partial(torch.optim.AdamW, lr=1e-2)},
    )
    datamodule = ChatDataModule(
        tokenizer, addition_rows("train", 48), batch_size=4, max_length=64, steps_per_generation=3, seed=5
    )
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = small_trainer(
        tmp_path, csv=True, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(every)
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return logged(tmp_path, "train/loss"), logged(tmp_path, "train/on_policy"), module


def test_resume_mid_group_and_mid_epoch_repeats_the_uninterrupted_run_exactly(tokenizer, tmp_path):
    from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

    def models():
        return tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0), tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)

    # 48 rows, batch 4, k=3: 12 micro-batches per epoch; 16 steps cross an epoch boundary
    full_losses, full_flips, _ = _run(*models(), tokenizer, tmp_path / "full", max_steps=16)
    # stop after step 7 (in the middle of the third group), then resume from that checkpoint
    _run(*models(), tokenizer, tmp_path / "first", max_steps=16, every=7)
    ckpt = tmp_path / "first" / "ckpt" / "epoch=0-step=7.ckpt"
    assert ckpt.exists()
    resumed_losses, resumed_flips, _ = _run(
        *models(), tokenizer, tmp_path / "resumed", max_steps=16, ckpt_path=str(ckpt)
    )
    assert len(full_losses) == 16 and len(resumed_losses) == 9
    assert resumed_flips == full_flips[7:]
    assert resumed_losses == full_losses[7:]  # bit-exact on CPU
    assert 0 < sum(full_flips) < 16  # both kinds of groups happened


def test_every_row_covers_the_whole_dataset_from_any_rank(tokenizer):
    """A rank's training loader holds its share; every_row() (used to precompute DPO reference log-probs) has all."""
    rows = addition_rows("train", 10)
    loader = GroupedBatches(RowDataset(rows), ChatMLCollator(tokenizer, 64), batch_size=4, rank=1, world_size=2)
    assert sum(batch["input_ids"].shape[0] for batch in loader) == 5
    full = list(loader.every_row())
    assert [batch["input_ids"].shape[0] for batch in full] == [4, 4, 2]
    expected = ChatMLCollator(tokenizer, 64)(rows[:4])
    assert torch.equal(full[0]["input_ids"], expected["input_ids"])  # in order, unshuffled


def test_select_rows_trims_the_sampled_logprobs_with_the_columns_of_their_tokens():
    """A sampled batch's ``sampled_logprobs`` sit at their tokens' columns: cutting rows keeps them there."""
    ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 3, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    logprobs = torch.tensor([[0.0, 0.0, -0.5, -0.7, 0.0], [0.0, 0.0, -0.2, 0.0, 0.0]])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids, "sampled_logprobs": logprobs}
    first = select_rows(batch, [0])
    assert first["input_ids"].tolist() == [[5, 6, 7]]
    assert torch.equal(first["sampled_logprobs"], logprobs[:1, 1:4])
