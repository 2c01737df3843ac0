"""lightning_gkd.cli.compose: a method built from conf/method with the command line's keys is the module the Python API
builds with the same settings, and a whole run in this process returns what `lightning-gkd` reports."""

from functools import partial

import pytest
import torch
from helpers.hydra_compose import FAST

from lightning_gkd import GKDModule
from lightning_gkd.cli.compose import build_method, compose_train, held_out_after, train
from lightning_gkd.samplers import KVCacheSampler


def flat(values, prefix=""):
    """A module's hyper-parameters by dotted key (the settings groups are nested dicts)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def test_a_method_from_the_configs_has_the_python_apis_settings(tokenizer, student, teacher):
    optimizer = partial(torch.optim.AdamW, lr=1e-3)
    settings = [
        "method.lmbda=1.0",
        "method.divergence.beta=0.25",
        "method.sampling.temperature=0.7",
        "method.sampling.max_new_tokens=6",
        "seed=5",
    ]
    built = build_method(
        ["method=gkd", *settings], student=student, teacher=teacher, tokenizer=tokenizer, optimizer=optimizer
    )
    direct = GKDModule(
        student,
        teacher,
        tokenizer,
        lmbda=1.0,
        divergence={"beta": 0.25},
        sampling={"temperature": 0.7, "max_new_tokens": 6},
        training={"seed": 5},
    )
    assert type(built) is GKDModule and built.student is student and built.training_settings.optimizer is optimizer
    # every setting both have agrees, but conf/method's validation.max_new_tokens (8, the toy task's; the class: 32)
    built_values, direct_values = flat(built.hparams), flat(direct.hparams)
    differ = {key for key in set(built_values) & set(direct_values) if built_values[key] != direct_values[key]}
    assert differ == {"validation.max_new_tokens"}
    assert isinstance(built.sampler, KVCacheSampler) and built.sampler.temperature == 0.7


def test_sft_and_dpo_are_built_from_their_method_configs(tokenizer, student, teacher):
    sft = build_method(["method=sft"], model=student, tokenizer=tokenizer)
    dpo = build_method(["method=dpo", "method.beta=0.2"], model=student, reference=teacher, tokenizer=tokenizer)
    assert type(sft).__name__ == "SFTModule" and type(dpo).__name__ == "DPOModule"
    assert dpo.hparams["beta"] == 0.2


def test_the_composed_config_writes_where_it_is_told(tmp_path):
    cfg = compose_train(["trainer.max_steps=3"], output_dir=tmp_path / "run")
    assert cfg.paths.output_dir == str(tmp_path / "run") and cfg.trainer.max_steps == 3


def test_a_run_in_this_process_returns_its_result(tmp_path):
    overrides = [*FAST, "model=tiny", f"paths.cache_dir={tmp_path / 'cache'}", "+data.test_data.num_rows=8"]
    result = train([*overrides, "export=false", "callbacks.sample_table=null"], output_dir=tmp_path / "run")
    assert result["global_step"] == 3 and result["metrics"]["train/loss"] > 0
    assert 0.0 <= held_out_after(result) <= 1.0
    with pytest.raises(ValueError, match="no held-out 'bleu' after training"):
        held_out_after(result, "bleu")
