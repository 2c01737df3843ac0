"""Hugging Face export: a plain student, a LoRA student (adapter + merged model), per-checkpoint exports
(HFExportCallback) and the Hydra run's student/ and student_merged/ folders; every folder reloads to the same
logits as the in-memory model."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers.fitting import small_trainer
from helpers.hydra_compose import FAST, compose_train
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.callbacks.hf_export import HFExportCallback
from lightning_gkd.cli.train import run
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy.tiny import TINY_STUDENT, tiny_causal_lm

peft = pytest.importorskip("peft")
# peft 0.21 reads transformers' deprecated is_gradient_checkpointing when it reloads an adapter.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

ATOL = 1e-5


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer

    folder = tmp_path_factory.mktemp("base") / "student"
    tiny_causal_lm(TINY_STUDENT, build_chatml_tokenizer(), seed=0).save_pretrained(folder)
    return str(folder)


def lora_module(base_folder, teacher, tokenizer):
    spec = {"name_or_path": base_folder, "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}}
    optimizer = partial(torch.optim.AdamW, lr=1e-2)
    return GKDModule(
        spec, teacher, tokenizer, lmbda=0.0, sampling={"max_new_tokens": 6}, training={"optimizer": optimizer}
    )


def probe(tokenizer):
    batch = tokenizer(
        ["<|im_start|>user\n123+456=<|im_end|>\n<|im_start|>assistant\n", "7+8="], padding=True, return_tensors="pt"
    )
    return batch.input_ids, batch.attention_mask


@torch.no_grad()
def logits(model, tokenizer):
    ids, mask = probe(tokenizer)
    return model.eval()(input_ids=ids, attention_mask=mask).logits


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def perturb_adapters(model):
    """Nonzero lora_B, as after training, so the adapters change the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))


def fit(module, tokenizer, rows, tmp_path, max_steps, callbacks):
    data = ChatDataModule(tokenizer, rows["train"], rows["val"], batch_size=4, max_length=64)
    trainer = small_trainer(
        tmp_path,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    trainer.fit(module, datamodule=data)
    return trainer


def test_plain_export_reloads_to_the_same_logits(student, teacher, tokenizer, tmp_path):
    module = GKDModule(student, teacher, tokenizer)
    folder = module.export(tmp_path / "student", merged_path=tmp_path / "student_merged")
    assert (folder / "model.safetensors").is_file() and (folder / "README.md").is_file()
    assert not (tmp_path / "student_merged").exists()  # merged_path means nothing without adapters
    expected = logits(module.student, tokenizer)
    diff = max_diff(logits(AutoModelForCausalLM.from_pretrained(folder), tokenizer), expected)
    print(f"plain export: max |logit diff| after reload = {diff:.2e}")
    assert diff <= ATOL


def test_lora_export_writes_the_adapter_and_a_merged_copy(base_folder, teacher, tokenizer, tmp_path):
    module = lora_module(base_folder, teacher, tokenizer)
    perturb_adapters(module.student)
    state_before = {k: v.clone() for k, v in module.student.state_dict().items()}
    expected = logits(module.student, tokenizer)

    adapter = module.export(tmp_path / "student", card_info={"note": "x"}, merged_path=tmp_path / "student_merged")
    merged = tmp_path / "student_merged"

    assert sorted(p.name for p in tmp_path.iterdir()) == ["student", "student_merged"]  # no staging leftovers
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "model.safetensors").exists()  # the adapter only, not a copy of the base
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    for folder in (adapter, merged):
        card = (folder / "README.md").read_text()
        assert "## Method: GKDModule" in card and "- note: x" in card
        assert (folder / "tokenizer_config.json").is_file()
    assert "LoRA adapter (peft)" in (adapter / "README.md").read_text()
    assert "adapters merged into the base weights" in (merged / "README.md").read_text()
    # The training model is untouched: still a PeftModel with the same (unmerged) weights and outputs.
    assert isinstance(module.student, peft.PeftModel)
    assert all(torch.equal(v, state_before[k]) for k, v in module.student.state_dict().items())
    assert max_diff(logits(module.student, tokenizer), expected) == 0.0

    diffs = {
        "AutoPeftModelForCausalLM(adapter)": peft.AutoPeftModelForCausalLM.from_pretrained(adapter),
        "PeftModel.from_pretrained(base, adapter)": peft.PeftModel.from_pretrained(
            load_causal_lm(base_folder), adapter
        ),
        "AutoModelForCausalLM(merged)": AutoModelForCausalLM.from_pretrained(merged),
    }
    diffs = {name: max_diff(logits(model, tokenizer), expected) for name, model in diffs.items()}
    print("LoRA export: max |logit diff| after reload:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(diff <= ATOL for diff in diffs.values()), diffs
    base = load_causal_lm(base_folder)
    assert max_diff(logits(base, tokenizer), expected) > 1e-2  # the adapters matter, so the checks above do


@pytest.mark.parametrize("lora, every_n_train_steps", [(True, None), (True, 2), (False, None)])
def test_export_callback_writes_a_folder_per_checkpoint(
    base_folder, teacher, tokenizer, toy_rows, tmp_path, lora, every_n_train_steps
):
    if lora:
        module = lora_module(base_folder, teacher, tokenizer)
    else:
        module = GKDModule(
            base_folder, teacher, tokenizer, lmbda=0.0, training={"optimizer": partial(torch.optim.AdamW, lr=1e-2)}
        )
    checkpoints = tmp_path / "checkpoints"
    callbacks = [HFExportCallback(checkpoints, every_n_train_steps=every_n_train_steps)]
    if every_n_train_steps is None:  # at each checkpoint save (step 2, step 4 and last.ckpt at step 4)
        callbacks.insert(
            0,
            ModelCheckpoint(
                dirpath=checkpoints,
                filename="step{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=2,
                save_top_k=-1,
                save_last=True,
            ),
        )
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=4, callbacks=callbacks)

    names = sorted(p.name for p in checkpoints.iterdir())
    ckpts = ["last.ckpt", "step2.ckpt", "step4.ckpt"] if every_n_train_steps is None else []
    folders = ["step2-hf", "step2-hf-merged", "step4-hf", "step4-hf-merged"] if lora else ["step2-hf", "step4-hf"]
    assert names == sorted([*ckpts, *folders])
    assert sorted(callbacks[-1].exported) == [2, 4]
    load = peft.AutoPeftModelForCausalLM.from_pretrained if lora else AutoModelForCausalLM.from_pretrained
    expected = logits(module.student, tokenizer)  # the model after step 4
    step4 = {"step4": load(checkpoints / "step4-hf")}
    if lora:
        step4["step4 merged"] = AutoModelForCausalLM.from_pretrained(checkpoints / "step4-hf-merged")
    diffs = {name: max_diff(logits(model, tokenizer), expected) for name, model in step4.items()}
    step2 = logits(load(checkpoints / "step2-hf"), tokenizer)
    if lora:
        diffs["step2 merged vs step2"] = max_diff(
            logits(AutoModelForCausalLM.from_pretrained(checkpoints / "step2-hf-merged"), tokenizer), step2
        )
    print(
        f"per-checkpoint export (lora={lora}, every_n_train_steps={every_n_train_steps}): max |logit diff| "
        f"{diffs}; step 2 vs step 4: {max_diff(step2, expected):.2e}"
    )
    assert all(diff <= ATOL for diff in diffs.values())
    assert max_diff(step2, expected) > 1e-4  # step 2 is an earlier model
    if every_n_train_steps is None:  # the step-2 folder holds the same weights as step2.ckpt
        state = torch.load(checkpoints / "step2.ckpt", weights_only=True)["state_dict"]
        fresh = lora_module(base_folder, teacher, tokenizer).student if lora else load_causal_lm(base_folder)
        fresh.load_state_dict({key.removeprefix("model."): value for key, value in state.items()})
        assert max_diff(logits(fresh, tokenizer), step2) <= ATOL


def test_hydra_run_with_a_lora_student_exports_adapter_merged_and_per_checkpoint(tmp_path):
    cfg = compose_train(
        tmp_path, [*FAST, "model.student.lora.r=4", "method.lmbda=0.0", "callbacks=[default,hf_export]"]
    )
    assert cfg.method.student.lora.r == 4 and cfg.export_merged is True
    result = run(cfg)
    run_dir = tmp_path / "run"
    assert result["global_step"] == 3
    assert result["student_dir"] == str(run_dir / "student")
    assert result["merged_dir"] == str(run_dir / "student_merged")
    assert (run_dir / "student" / "adapter_model.safetensors").is_file()
    assert not (run_dir / "student" / "model.safetensors").exists()
    adapter = peft.AutoPeftModelForCausalLM.from_pretrained(run_dir / "student")
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "student_merged")
    checkpoint = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step3-hf-merged")
    tok = load_tokenizer(str(run_dir / "student"))  # the run's tokenizer is saved beside the adapter
    reference = logits(adapter, tok)
    diffs = {
        "merged": max_diff(logits(merged, tok), reference),
        "step3-hf-merged": max_diff(logits(checkpoint, tok), reference),
    }
    print("Hydra LoRA run: max |logit diff| vs the exported adapter:", diffs)
    scale = max(1.0, reference.abs().max().item())  # W + BA vs Wx + B(Ax): float32 rounding of logits this large
    assert all(diff <= ATOL * scale for diff in diffs.values())
    assert (run_dir / "checkpoints" / "step3-hf" / "adapter_config.json").is_file()
    # Only the adapters trained: the merged export differs from the shipped student start.
    base = AutoModelForCausalLM.from_pretrained(cfg.model.student.name_or_path)
    assert max_diff(logits(base, tok), reference) > 0


def test_hydra_run_with_export_merged_false_writes_the_adapter_only(tmp_path):
    cfg = compose_train(
        tmp_path, [*FAST, "model.student.lora.r=4", "export_merged=false", "callbacks=none", "method.lmbda=0.0"]
    )
    result = run(cfg)
    assert result["merged_dir"] is None and not (tmp_path / "run" / "student_merged").exists()
    assert (tmp_path / "run" / "student" / "adapter_config.json").is_file()


def test_export_callback_refuses_sharded_training_with_a_way_out():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_gkd.callbacks.hf_export import HFExportCallback

    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    with pytest.raises(ValueError, match=r"trainer=fsdp.*callbacks=\[default\]"):
        HFExportCallback("ckpts").setup(trainer, None, "fit")
