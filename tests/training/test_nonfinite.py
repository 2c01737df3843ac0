"""A non-finite loss stops the run naming the step and the model with non-finite logits, or (nonfinite="skip")
skips the batch; tested by injecting NaN into one model's logits with a forward hook."""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, DPOModule, GKDModule, PreferenceDataModule, SFTModule
from lightning_gkd.methods.base import MAX_CONSECUTIVE_SKIPS
from lightning_gkd.toy.preference import addition_preference_rows


def poison(model: torch.nn.Module, when=lambda: True) -> list[int]:
    """Put NaN into ``model``'s final hidden states (so into its logits too) on every forward for which ``when()``
    is true; returns the call log. Hooked on the decoder, so it hits the hidden-state loss path as well."""
    calls: list[int] = []

    def hook(module, args, output):
        calls.append(1)
        if when():
            output.last_hidden_state[0] = float("nan")

    model.get_decoder().register_forward_hook(hook)
    return calls


def chat_data(tokenizer, toy_rows) -> ChatDataModule:
    return ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)


def make(kind: str, student, teacher, tokenizer, **kwargs) -> L.LightningModule:
    """A module of ``kind`` with ``kwargs`` its training settings."""
    training = {"optimizer": partial(torch.optim.AdamW, lr=1e-3), **kwargs}
    if kind == "gkd":
        return GKDModule(student, teacher, tokenizer, lmbda=0.0, sampling={"max_new_tokens": 4}, training=training)
    if kind == "sft":
        return SFTModule(student, tokenizer, training=training)
    return DPOModule(student, tokenizer, reference=copy.deepcopy(student), training=training)


@pytest.mark.parametrize(
    "kind, poisoned, named",
    [
        ("gkd", "teacher", "the teacher produced non-finite logits"),
        ("gkd", "model", "the student produced non-finite logits"),
        ("sft", "model", "the model produced non-finite logits"),
        ("dpo", "reference", "the reference produced non-finite logits"),
        ("dpo", "model", "the policy produced non-finite logits"),
    ],
)
def test_nan_logits_stop_the_run_naming_step_and_model(
    student, teacher, tokenizer, toy_rows, tmp_path, kind, poisoned, named
):
    module = make(kind, student, teacher, tokenizer)
    step = {"n": 0}
    poison(getattr(module, poisoned), when=lambda: step["n"] >= 2)

    class Count(L.Callback):
        def on_train_batch_end(self, *args):
            step["n"] += 1

    data = (
        PreferenceDataModule(tokenizer, addition_preference_rows("train", 16), batch_size=2)
        if kind == "dpo"
        else chat_data(tokenizer, toy_rows)
    )
    trainer = small_trainer(tmp_path, max_steps=5, callbacks=[Count()])
    with pytest.raises(
        RuntimeError,
        match=rf"Non-finite training loss \(nan\) at global step 2: {named} \(NaN or "
        r"inf\)\. The model was not updated with it\..*method\.training\.nonfinite=skip",
    ):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in module.model.parameters())


def test_a_loss_that_overflows_on_finite_logits_says_so(student, teacher, tokenizer, toy_rows, tmp_path, monkeypatch):
    module = make("gkd", student, teacher, tokenizer)
    original = GKDModule.distillation_loss
    monkeypatch.setattr(
        GKDModule,
        "distillation_loss",
        lambda self, batch: replace(out := original(self, batch), loss=out.loss * float("inf")),
    )
    with pytest.raises(
        RuntimeError,
        match=r"loss \(inf\) at global step 0: the logits \(student, teacher\) are "
        r"finite, so the "
        r"loss computation itself overflowed",
    ):
        small_trainer(tmp_path, max_steps=2).fit(module, datamodule=chat_data(tokenizer, toy_rows))


def test_skip_option_skips_the_poisoned_batch_and_trains_on(student, teacher, tokenizer, toy_rows, tmp_path):
    module = make("gkd", student, teacher, tokenizer, nonfinite="skip")
    batches = {"n": 0}
    poison(module.teacher, when=lambda: batches["n"] == 1)  # the second training batch only

    class Count(L.Callback):
        def on_train_batch_end(self, *args):
            batches["n"] += 1

    before = {k: v.clone() for k, v in module.student.state_dict().items()}
    with pytest.warns(
        UserWarning,
        match=r"Non-finite training loss \(nan\) at global step 1: the teacher produced "
        r"non-finite logits \(NaN or inf\)\. Skipping this batch",
    ):
        trainer = small_trainer(tmp_path, max_steps=3, callbacks=[Count()])
        trainer.fit(module, datamodule=chat_data(tokenizer, toy_rows))
    assert batches["n"] == 3 and trainer.global_step == 3  # Lightning counts the skipped batch's (empty) step
    assert all(torch.isfinite(p).all() for p in module.student.parameters())
    assert any(not torch.equal(v, before[k]) for k, v in module.student.state_dict().items())
    assert module.trained_tokens > 0


def test_skip_gives_up_after_too_many_bad_batches_in_a_row(student, teacher, tokenizer, toy_rows, tmp_path):
    module = make("gkd", student, teacher, tokenizer, nonfinite="skip")
    poison(module.teacher)
    with (
        pytest.warns(UserWarning, match="Skipping this batch"),
        pytest.raises(
            RuntimeError, match=rf"That is {MAX_CONSECUTIVE_SKIPS} skipped batches in a row, so the run is stopped"
        ),
    ):
        small_trainer(tmp_path, max_steps=100).fit(module, datamodule=chat_data(tokenizer, toy_rows))
