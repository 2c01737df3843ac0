"""The CausalLMModule contract: a method refuses a datamodule holding the other kind of rows, with a plain Trainer;
every method frees its gradients right after each optimizer step."""

import copy
import json
import subprocess
import sys

import lightning as L
import pytest
from helpers.gradient_probe import GradientsAtBatchStart, StepAsLightningDoes
from helpers.launch import clean_env
from helpers.paths import HELPERS

from lightning_gkd import ChatDataModule, DPOModule, GKDModule, PreferenceDataModule
from lightning_gkd.methods.base import check_data_format
from lightning_gkd.toy.preference import addition_preference_rows


def _trainer(tmp_path, max_steps=1, **kwargs):
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
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


def _method_and_data(kind, student, teacher, tokenizer, toy_rows, reference_step=False):
    from functools import partial

    import torch

    from lightning_gkd import OPDModule, SFTModule
    from lightning_gkd.samplers import KVCacheSampler

    optimizer = partial(torch.optim.AdamW, lr=1e-2)
    sampler = partial(KVCacheSampler, matmul_precision="highest")
    if kind == "dpo":
        cls, args = DPOModule, (student, tokenizer, copy.deepcopy(student))
        data = PreferenceDataModule(tokenizer, addition_preference_rows("train", 16), batch_size=4, max_length=64)
        kwargs = {}
    else:
        cls = {"gkd": GKDModule, "opd": OPDModule, "sft": SFTModule}[kind]
        args = (student, tokenizer) if kind == "sft" else (student, teacher, tokenizer)
        kwargs = {} if kind == "sft" else {"max_new_tokens": 4, "sampler": sampler, "frozen_dtype": "float32"}
        kwargs |= {"lmbda": 1.0} if kind == "gkd" else {}
        data = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    if reference_step:
        cls = type(f"Reference{cls.__name__}", (StepAsLightningDoes, cls), {})
    return cls(*args, optimizer=optimizer, **kwargs), data


@pytest.mark.parametrize("kind", ["gkd", "opd", "sft", "dpo"])
def test_gradients_are_freed_after_each_step_and_training_is_unchanged(tmp_path, tokenizer, toy_rows, kind):
    """The previous step's gradients are gone before the next step samples and runs its forwards (they used to
    live until Lightning's zero_grad inside the next closure); losses and weights after 3 steps are those of
    Lightning's own step, bit for bit."""
    import torch

    from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm

    runs = {}
    for reference in (False, True):
        student, teacher = (
            tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
            tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1),
        )
        module, data = _method_and_data(kind, student, teacher, tokenizer, toy_rows, reference_step=reference)
        probe, losses = GradientsAtBatchStart(), LossRecorder()
        _trainer(tmp_path, max_steps=3, callbacks=[probe, losses]).fit(module, datamodule=data)
        runs[reference] = (probe.seen, losses.losses, [p.detach().clone() for p in student.parameters()])
    assert runs[False][0] == [False, False, False]
    assert runs[True][0] == [False, True, True]  # Lightning's own step: the last step's gradients linger
    assert runs[False][1] == runs[True][1] and len(runs[False][1]) == 3
    assert all(torch.equal(a, b) for a, b in zip(runs[False][2], runs[True][2], strict=True))


def test_gradients_are_kept_between_accumulated_micro_batches(tmp_path, tokenizer, student, teacher, toy_rows):
    module, data = _method_and_data("gkd", student, teacher, tokenizer, toy_rows)
    probe = GradientsAtBatchStart()
    _trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[probe]).fit(module, datamodule=data)
    assert probe.seen == [False, True, False, True]  # freed at each real step, summed within the window


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


WORKER = HELPERS / "gradient_freeing_worker.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gradients_are_freed_under_ddp_and_fsdp2(kind, tmp_path):
    """DDP and FSDP2 (ModelParallelStrategy), 2 gloo processes, lmbda 1: on every rank the gradients are gone when the
    next step starts sampling, and losses and trained weights equal Lightning's own step bit for bit."""
    out = tmp_path / "run"
    command = [sys.executable, str(WORKER), str(out), kind]
    done = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["strategy"] == {"ddp": "DDPStrategy", "fsdp": "ModelParallelStrategy"}[kind]
        assert result["grads_at_batch_start"] == [False, False, False]
        assert result["reference_grads_at_batch_start"] == [False, True, True]  # Lightning's step: they linger
        assert result["losses"] == result["reference_losses"] and len(result["losses"]) == 3
        if rank == 0:
            assert result["weights_compared"] > 0 and result["unequal"] == []
