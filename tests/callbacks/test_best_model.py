"""BestModel (lightning_gkd/callbacks/best_model.py): the start scored as validation scores it, the warning and the
stop when a run stays below it, and the best checkpoint restored at the end for the held-out "after" and the export,
through real fits of the shipped toy student driven worse on purpose (a learning rate far too large)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from helpers.fitting import small_trainer

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.callbacks import BestModel, HeldOutEvaluation
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation import evaluate_generations, exact_match
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

VAL_ROWS = 32


@pytest.fixture(scope="module")
def toy():
    tokenizer = load_tokenizer(asset_path("toy/teacher"))
    return tokenizer, load_causal_lm(asset_path("toy/teacher")), load_causal_lm(asset_path("toy/student_init"))


def module_for(toy, lr: float) -> GKDModule:
    tokenizer, teacher, student = toy
    return GKDModule(
        copy.deepcopy(student),
        teacher,
        tokenizer,
        lmbda=0.0,
        divergence={"beta": 0.0},
        training={"optimizer": partial(torch.optim.SGD, lr=lr)},
        validation={"metrics": {"accuracy": exact_match}, "max_new_tokens": 8},
    )


def fit(toy, module, tmp_path, callbacks, max_steps=8):
    tokenizer = toy[0]
    data = ChatDataModule(
        tokenizer,
        addition_rows("train", 256),
        addition_rows("val", VAL_ROWS),
        test_data=addition_rows("test", 32),
        batch_size=8,
        val_batch_size=16,
        max_length=64,
    )
    trainer = small_trainer(
        tmp_path, max_steps=max_steps, val_check_interval=2, limit_val_batches=1, callbacks=callbacks
    )
    trainer.fit(module, datamodule=data)
    return trainer


def test_a_run_that_stays_below_its_start_is_told_and_stopped(toy, tmp_path, recwarn):
    module = module_for(toy, lr=5.0)  # far too large: the student falls apart
    start = evaluate_generations(copy.deepcopy(toy[2]), toy[0], addition_rows("val", 16), max_new_tokens=8)
    best = BestModel(patience=2, stop=True)
    trainer = fit(toy, module, tmp_path, [best], max_steps=20)
    assert best.start == start["accuracy"] > 0  # the first limit_val_batches=1 batch of 16 prompts, greedy
    assert trainer.global_step == 4  # stopped at the second validation below the start (steps 2 and 4)
    assert best.below == 2 and best.below_start.startswith("val/accuracy has been below its start for 2 validations")
    warned = [str(w.message) for w in recwarn if "BestModel:" in str(w.message)]
    assert len(warned) == 1 and "lower optimizer.lr" in warned[0]
    assert best.run_summary()["below_start"] == best.below_start


def test_the_best_checkpoint_is_restored_for_the_held_out_after_and_the_export(toy, tmp_path):
    module = module_for(toy, lr=1.0)
    best, held_out = BestModel(load_at_end=True), HeldOutEvaluation(max_new_tokens=8)
    fit(toy, module, tmp_path, [best, held_out], max_steps=8)
    path = tmp_path / "checkpoints" / "best.ckpt"
    assert best.loaded == str(path) and best.best is not None
    assert best.best["step"] < 8  # an earlier step than the last: the weights at the end are not the last step's
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == best.best["step"]
    weights = {k.removeprefix("model."): v for k, v in saved["state_dict"].items() if k.startswith("model.")}
    assert all(torch.equal(weights[k], v) for k, v in module.student.state_dict().items())
    # the held-out "after" scored the restored weights
    restored = load_causal_lm(asset_path("toy/student_init"))
    restored.load_state_dict(weights)
    expected = evaluate_generations(restored, toy[0], addition_rows("test", 32), max_new_tokens=8)
    assert held_out.results["after"]["accuracy"] == expected["accuracy"]
    exported = module.export(tmp_path / "student")
    assert torch.equal(
        load_causal_lm(exported).state_dict()["lm_head.weight"], module.student.state_dict()["lm_head.weight"]
    )


def test_without_load_at_end_nothing_is_saved_and_the_last_weights_stay(toy, tmp_path):
    module = module_for(toy, lr=1e-3)
    best = BestModel()
    fit(toy, module, tmp_path, [best], max_steps=4)
    assert best.best is not None and best.loaded is None
    assert not (tmp_path / "checkpoints" / "best.ckpt").exists()


@pytest.mark.parametrize(
    ("options", "match"),
    [({"mode": "up"}, r"mode must be one of"), ({"patience": 0}, r"patience must be an integer >= 1")],
)
def test_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        BestModel(**options)
