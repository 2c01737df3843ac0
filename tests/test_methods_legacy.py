"""lightning_gkd.methods.legacy: ``dataset_loss``, the loss hook's old name, keeps working for a release: calling it
on a module, and a subclass that still overrides it (whose super() call must reach the built-in loss)."""

import warnings

import pytest
import torch
from test_methods_gkd import fit, logged, make_module

from lightning_gkd import ChatDataModule, GKDModule, SFTModule


def val_batch(tokenizer, toy_rows):
    data = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4, max_length=64)
    data.setup("fit")
    return next(iter(data.val_dataloader()))


def test_calling_dataset_loss_warns_and_runs_the_loss_hook(student, teacher, tokenizer, toy_rows):
    batch = val_batch(tokenizer, toy_rows)
    gkd = make_module(student, teacher, tokenizer)
    sft = SFTModule(student, tokenizer)
    with torch.no_grad():
        for module, hook in ((gkd, gkd.distillation_loss), (sft, sft.completion_loss)):
            with pytest.warns(DeprecationWarning, match="dataset_loss is deprecated"):
                legacy = module.dataset_loss(batch)
            assert torch.equal(legacy, hook(batch))


def test_a_subclass_overriding_dataset_loss_still_trains_on_its_override(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    with pytest.warns(DeprecationWarning, match="overrides dataset_loss, which is now named distillation_loss"):

        class Doubled(GKDModule):
            def dataset_loss(self, batch):
                return 2 * super().dataset_loss(batch)

    batch = val_batch(tokenizer, toy_rows)
    module = Doubled(student, teacher, tokenizer, lmbda=0.0, max_new_tokens=4)
    plain = make_module(student, teacher, tokenizer, lmbda=0.0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        expected = 2 * plain.distillation_loss(batch)
        assert torch.allclose(module.distillation_loss(batch), expected)  # the override is the loss hook
        assert torch.allclose(module.dataset_loss(batch), expected)
        assert torch.allclose(module.completion_loss(batch), expected)  # validation's entry
    calls = []
    original = Doubled.distillation_loss
    Doubled.distillation_loss = lambda self, b: calls.append(1) or original(self, b)
    try:
        fit(module, tokenizer, toy_rows, tmp_path, max_steps=2)
    finally:
        Doubled.distillation_loss = original
    # two training steps, the sanity check's validation batch and the end-of-fit validation batch
    assert len(calls) == 2 + 1 + 1
    assert len(logged(tmp_path, "train/loss")) == 2
