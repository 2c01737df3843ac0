"""LoRA students from a spec (``{"name_or_path": ..., "lora": {"r": 8, ...}}``): only the adapters train, the base
weights stay bit-identical, sampling and DPO's adapters-disabled reference work with them."""

from __future__ import annotations

import copy
import sys
from functools import partial

import pytest
import torch

from lightning_gkd import DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.models.lora import apply_lora, lora_config, lora_enabled
from lightning_gkd.ops.decoding.sampling import sample_tokens
from lightning_gkd.ops.hf.forward import unwrap
from lightning_gkd.toy.preference import addition_preference_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm

peft = pytest.importorskip("peft")

from helpers.fitting import fit, small_trainer  # noqa: E402  (the shared tiny GKD fit and Trainer)

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """The tiny student saved with save_pretrained, so specs load it by name_or_path like a hub id."""
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer

    folder = tmp_path_factory.mktemp("base") / "student"
    tiny_causal_lm(TINY_STUDENT, build_chatml_tokenizer(), seed=0).save_pretrained(folder)
    return str(folder)


def lora_spec(base_folder, **lora):
    return {"name_or_path": base_folder, "init_kwargs": {"dtype": "float32"}, "lora": {**LORA, **lora}}


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def adapter_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_spec_trains_only_the_adapters(base_folder, teacher, tokenizer, toy_rows, tmp_path):
    module = GKDModule(
        lora_spec(base_folder),
        teacher,
        tokenizer,
        lmbda=0.5,
        sampling={"max_new_tokens": 6},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-2)},
    )
    student = module.student
    assert isinstance(student, peft.PeftModel)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    # all-linear: q, k, v, o, gate, up, down in each of the 2 layers, lora_A and lora_B each; not the lm_head
    assert len(trainable) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = module.configure_optimizers()  # no scheduler: the optimizer itself
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in student.named_parameters() if n in trainable}
    base_before, adapters_before = base_weights(student), adapter_weights(student)
    assert all(not v.any() for n, v in adapters_before.items() if ".lora_B." in n)  # LoRA starts as the base

    trainer = fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)

    assert trainer.global_step == 3
    after = dict(student.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items())  # bit-identical base weights
    changed = [n for n, v in adapters_before.items() if not torch.equal(after[n], v)]
    assert len(changed) == len(adapters_before)  # every adapter matrix moved


def test_lora_config_defaults_aliases_and_errors(base_folder):
    config = lora_config({"r": 8})
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules) == (8, 16, 0.0, "all-linear")
    assert config.task_type == "CAUSAL_LM"
    config = lora_config(
        {"r": 2, "lora_alpha": 3, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "use_rslora": True}
    )
    assert (config.lora_alpha, config.lora_dropout, config.use_rslora) == (3, 0.1, True)
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    passed = peft.LoraConfig(r=2, task_type="CAUSAL_LM")
    assert lora_config(passed) is passed
    # The Hydra default (r: null) and null/{} mean a plain, fully trainable model.
    for off in (None, {}, {"r": None, "alpha": None, "dropout": 0.0, "target_modules": "all-linear"}):
        assert not lora_enabled(off)
        model = load_causal_lm({"name_or_path": base_folder, "lora": off})
        assert not isinstance(model, peft.PeftModel) and all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="lora.r must be a positive integer"):
        lora_config({"r": -1})
    with pytest.raises(ValueError, match="both 'alpha' and 'lora_alpha'"):
        lora_config({"r": 4, "alpha": 8, "lora_alpha": 8})
    with pytest.raises(ValueError, match="lora: .*no_such_knob"):
        lora_config({"r": 4, "no_such_knob": 1})
    with pytest.raises(ValueError, match="student: cannot add LoRA adapters .*target_modules"):
        load_causal_lm({"name_or_path": base_folder, "lora": {"r": 4, "target_modules": ["nope"]}}, role="student")
    with pytest.raises(ValueError, match="unknown key"):
        load_causal_lm({"name_or_path": base_folder, "lora": {"r": 4}, "lroa": 1})


def test_missing_peft_names_the_install_command(base_folder, monkeypatch):
    model = load_causal_lm(base_folder)
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install peft"):
        apply_lora(model, {"r": 4})


def test_sampling_from_a_lora_student_uses_the_adapters(base_folder, tokenizer):
    model = load_causal_lm(lora_spec(base_folder)).eval()
    assert type(unwrap(model)).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():  # move the adapters away from zero so that they change the outputs
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    prompts = tokenizer(["12+34=", "7+8="], padding=True, padding_side="left", return_tensors="pt")
    kwargs = dict(max_new_tokens=6, pad_token_id=tokenizer.pad_token_id, eos_token_id=None, do_sample=False)
    with_adapters = sample_tokens(model, prompts.input_ids, prompts.attention_mask, **kwargs)
    merged = copy.deepcopy(model).merge_and_unload().eval()
    assert torch.equal(with_adapters, sample_tokens(merged, prompts.input_ids, prompts.attention_mask, **kwargs))
    with model.disable_adapter():
        without = sample_tokens(model, prompts.input_ids, prompts.attention_mask, **kwargs)
    base = load_causal_lm(base_folder).eval()
    assert torch.equal(without, sample_tokens(base, prompts.input_ids, prompts.attention_mask, **kwargs))
    assert not torch.equal(with_adapters, without)
    sampled = sample_tokens(
        model,
        prompts.input_ids,
        prompts.attention_mask,
        **{**kwargs, "do_sample": True},
        temperature=0.9,
        generator=torch.Generator().manual_seed(0),
    )
    assert sampled.shape == (2, 6)


def test_dpo_with_a_lora_spec_uses_the_adapters_disabled_reference(base_folder, tokenizer, tmp_path):
    module = DPOModule(lora_spec(base_folder), tokenizer, training={"optimizer": partial(torch.optim.AdamW, lr=5e-2)})
    assert module.reference_source == "peft" and module.frozen_names == ()
    base_before = base_weights(module.policy)
    pairs = {"train": addition_preference_rows("train", 16), "val": addition_preference_rows("val", 4)}
    data = PreferenceDataModule(tokenizer, pairs["train"], pairs["val"], batch_size=4, max_length=64)
    trainer = small_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    after = dict(module.policy.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items())
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        reference, _ = module.completion_logps(load_causal_lm(base_folder).eval(), batch)
        ref_chosen, ref_rejected = module.reference_logps(batch)
    torch.testing.assert_close(torch.cat([ref_chosen, ref_rejected]), reference, atol=1e-5, rtol=0)


def test_hydra_dpo_with_a_lora_policy_and_no_reference_model(tmp_path):
    from helpers.hydra_compose import compose_train

    from lightning_gkd.cli.train import run

    cfg = compose_train(
        tmp_path,
        [
            "method=dpo",
            "model.student.lora.r=4",
            "method.reference=null",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1",
            "data.batch_size=4",
            "data.val_batch_size=4",
            "print_config=false",
            "callbacks=none",
            "export_merged=false",
        ],
    )
    result = run(cfg)
    assert result["global_step"] == 2 and result["metrics"]["val/loss"] > 0
    assert (tmp_path / "run" / "student" / "adapter_config.json").is_file() and result["merged_dir"] is None


def test_a_frozen_model_sharing_the_students_lora_spec_is_the_base_model(tmp_path):
    """DPO's default `reference: ${model.student}` copies the `lora` entry; the frozen reference drops it."""
    from helpers.hydra_compose import compose_train
    from hydra.utils import instantiate

    from lightning_gkd.cli import tokenizer_source
    from lightning_gkd.data.tokenizer import load_tokenizer

    cfg = compose_train(tmp_path, ["method=dpo", "model.student.lora.r=4"])
    assert cfg.method.reference.lora.r == 4  # the spec really is shared
    tokenizer = load_tokenizer(tokenizer_source(cfg.model))
    module = instantiate(cfg.method, tokenizer=tokenizer, _convert_="all")
    assert any("lora_" in name for name, _ in module.model.named_parameters())
    assert not any("lora_" in name for name, _ in module.reference.named_parameters())
    assert not any(p.requires_grad for p in module.reference.parameters())
