"""Mistakes the CLI refuses before any model weights load: data of the wrong kind for the method, a tokenizer the
student cannot embed; and the tokenizer that comes with a student given by path."""

import time

import pytest
from helpers.hydra_compose import compose_train
from transformers import AutoModelForCausalLM

from lightning_gkd.cli.train import build
from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm


@pytest.fixture()
def no_weights(monkeypatch):
    """Fail the test if any model's weights are loaded."""
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("model weights loaded"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["method=gkd", "data=toy_preference"],
            r"GKDModule trains on chat rows .* but the datamodule \(PreferenceDataModule\) holds preference pairs .*"
            r"Use method=dpo for this data",
        ),
        (["method=sft", "data=toy_preference"], r"SFTModule trains on chat rows"),
        (
            ["method=dpo", "data=toy"],
            r"DPOModule trains on preference pairs .* \(ChatDataModule\) holds chat rows .* Use method=gkd, "
            r"method=opd or method=sft for this data",
        ),
    ],
)
def test_data_of_the_wrong_kind_for_the_method_fails_before_models_load(tmp_path, no_weights, overrides, message):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        build(compose_train(tmp_path, overrides))
    assert time.perf_counter() - started < 30


def _bigger_tokenizer():
    tokenizer = build_chatml_tokenizer()
    tokenizer.add_tokens(["<tool>", "</tool>", "<think>"])
    return tokenizer


def test_a_student_given_by_path_brings_its_own_tokenizer(tmp_path):
    """Under model=toy, a new model.student.name_or_path used to keep the toy tokenizer silently."""
    tokenizer = _bigger_tokenizer()
    folder = tmp_path / "my_student"
    tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run = build(compose_train(tmp_path, [f"model.student.name_or_path={folder}", "method=sft"]))
    assert len(run.datamodule.tokenizer) == 262 and run.datamodule.tokenizer.convert_tokens_to_ids("<think>") == 261
    assert len(run.module.tokenizer) == 262


def test_a_tokenizer_larger_than_the_students_vocabulary_fails_before_models_load(tmp_path, no_weights):
    _bigger_tokenizer().save_pretrained(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"has 262 tokens but the student's vocabulary has 259: token ids 259 and up"):
        build(compose_train(tmp_path, [f"model.tokenizer={tmp_path / 'tok'}"]))


def test_a_mistyped_student_path_is_named_before_its_tokenizer_is_looked_for(tmp_path, no_weights, monkeypatch):
    """The tokenizer comes from the student's folder: a mistyped one must still fail as a missing folder."""
    monkeypatch.setattr("lightning_gkd.models.loading.hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(FileNotFoundError, match=r"student: no local folder 'models/studnet' \(relative to"):
        build(compose_train(tmp_path, ["model.student.name_or_path=models/studnet"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+method.lmbd=0.5"], r"method\.lmbd is not an option of GKDModule \(did you mean method\.lmbda\?\)\. "),
        (["method=opd", "+method.lmbda=0.5"], r"method\.lmbda is not an option of OPDModule.*method\.policy_gradient"),
    ],
)
def test_a_mistyped_method_key_names_the_options_before_anything_loads(tmp_path, no_weights, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(compose_train(tmp_path, overrides))
