"""Distillation with rows that hold images: tiny vision-language students and teachers (lightning_gkd.toy.tiny_vlm) on
the toy shape rows (lightning_gkd.toy.shapes), through real Lightning fits on CPU.

The two-process test runs tests/helpers/vlm_ddp_worker.py (Lightning re-runs that script for rank 1) and checks
what it measured; the FSDP2 one runs tests/helpers/vlm_fsdp_worker.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

import pytest
import torch
from helpers.fitting import small_trainer
from helpers.launch import TIMEOUT, clean_env
from helpers.paths import HELPERS

from lightning_gkd import ChatDataModule, GKDModule, OPDModule, SFTModule
from lightning_gkd.losses.dense import DenseDistillation
from lightning_gkd.losses.settings import DivergenceSettings
from lightning_gkd.models.vision import input_side_modules
from lightning_gkd.samplers.skd import SpeculativeKDSampler
from lightning_gkd.teachers.local import LocalTeacher
from lightning_gkd.toy.shapes import shape_rows
from lightning_gkd.toy.tiny import TINY_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tiny_vlm import VLM_FAMILIES, tiny_vlm

ADAMW = partial(torch.optim.AdamW, lr=1e-2)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return shape_rows("train", num_rows=8)


def vlm_pair(family: str = "llava"):
    student, processor = tiny_vlm(family, seed=0)
    teacher, _ = tiny_vlm(family, seed=1)
    return student, teacher, processor


def datamodule(processor, rows, **kwargs) -> ChatDataModule:
    settings = {"batch_size": 2, "max_length": 64, **kwargs}
    return ChatDataModule(processor.tokenizer, rows, processor=processor, **settings)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def split_by_side(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """Parameter names of the vision tower + projector (``input_side_modules``), and of everything else."""
    prefixes = tuple(f"{name}." for name in input_side_modules(model))
    assert prefixes, "a vision-language model has a vision side"
    names = [name for name, _ in model.named_parameters()]
    vision = {name for name in names if name.startswith(prefixes)}
    return vision, set(names) - vision


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module, names: set[str]) -> set[str]:
    now = dict(model.named_parameters())
    return {name for name in names if not torch.equal(before[name], now[name].detach())}


def gkd(student, teacher, processor, **kwargs) -> GKDModule:
    kwargs.setdefault("sampling", {"max_new_tokens": 4})
    # a float32 teacher (frozen_dtype="auto" would run it in bfloat16 on CPU): the teacher's weights stay as they were
    kwargs["training"] = {"optimizer": ADAMW, "frozen_dtype": "float32", **kwargs.get("training", {})}
    return GKDModule(student, teacher, processor.tokenizer, **kwargs)


# -- GKD through a real Trainer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lmbda, steps_per_generation", [(1.0, 1), (0.0, 1), (1.0, 2)], ids=["on_policy", "dataset", "grouped"]
)
def test_gkd_fit_trains_the_language_model_and_not_the_vision_side(rows, tmp_path, lmbda, steps_per_generation):
    student, teacher, processor = vlm_pair()
    vision, language = split_by_side(student)
    before, teacher_before = snapshot(student), snapshot(teacher)
    module = gkd(student, teacher, processor, lmbda=lmbda)
    trainer = small_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=datamodule(processor, rows, steps_per_generation=steps_per_generation))

    assert trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert float(trainer.callback_metrics["train/on_policy"]) == lmbda
    assert module.sampling_calls == (0 if lmbda == 0 else 2 // steps_per_generation)
    # frozen by default (method.training.freeze_vision): no gradients, untouched by the optimizer
    assert all(not p.requires_grad for name, p in student.named_parameters() if name in vision)
    assert not changed(before, student, vision)
    assert "lm_head.weight" in changed(before, student, language)
    assert len(changed(before, student, language)) > len(language) // 2
    assert not changed(teacher_before, teacher, set(teacher_before))


@pytest.mark.parametrize("lmbda", [1.0, 0.0], ids=["on_policy", "dataset"])
def test_gkd_fit_with_freeze_vision_false_trains_the_vision_side_too(rows, tmp_path, lmbda):
    student, teacher, processor = vlm_pair()
    vision, language = split_by_side(student)
    before = snapshot(student)
    module = gkd(student, teacher, processor, lmbda=lmbda, training={"freeze_vision": False})
    trainer = small_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=datamodule(processor, rows))

    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert all(p.requires_grad for p in student.parameters())
    moved = changed(before, student, vision)
    projector = {name for name in vision if "multi_modal_projector" in name}
    assert projector and projector <= moved  # the projector trains
    assert any(name.startswith("model.vision_tower.") for name in moved)  # and the tower
    assert len(changed(before, student, language)) > len(language) // 2


# -- the lean loss reads the images as the full-logits loss does -------------------------------------------------------
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_lean_loss_equals_the_full_logits_loss_on_a_batch_with_images(rows, family):
    student, teacher, processor = vlm_pair(family)
    data = datamodule(processor, rows[:3])
    batch = data.collator(rows[:3])
    assert len(batch["vision"]) == 3 and all(batch["vision"])
    losses, grads = {}, {}
    for lean in (True, False):
        loss = DenseDistillation(LocalTeacher(teacher), DivergenceSettings(beta=0.5, lean_loss=lean))
        student.zero_grad()
        out = loss(student, batch)
        out.loss.backward()
        assert loss.lean.enabled is lean  # the lean path ran (it turns off when it falls back to full logits)
        losses[lean] = out.loss.detach()
        grads[lean] = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    assert torch.isfinite(losses[True]) and losses[True] > 0
    torch.testing.assert_close(losses[True], losses[False], atol=1e-5, rtol=0)
    assert grads[True].keys() == grads[False].keys()
    for name in grads[True]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=1e-5, rtol=1e-4, msg=name)


# -- the other methods ---------------------------------------------------------------------------------------------
def test_seq_kd_with_images_trains_on_the_teachers_samples_of_those_images(rows, tmp_path):
    student, teacher, processor = vlm_pair()
    seen: list = []
    sampled = GKDModule.sample_batch

    def record(self, model, batch, seed):
        out = sampled(self, model, batch, seed)
        seen.append((model is self.teacher, out))
        return out

    module = gkd(student, teacher, processor, lmbda=0.0, seq_kd=True)
    module.sample_batch = record.__get__(module)
    trainer = small_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=datamodule(processor, rows))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert [by_teacher for by_teacher, _ in seen] == [True, True]
    for _, batch in seen:  # each sample was written from its row's own images, and carries them to the losses
        assert len(batch["vision"]) == batch["input_ids"].shape[0] and all(row for row in batch["vision"])
        image = teacher.config.image_token_id  # the samples hold no image token the prompts did not
        torch.testing.assert_close((batch["input_ids"] == image).sum(1), (batch["prompts"] == image).sum(1))


def test_sft_fit_with_images(rows, tmp_path):
    model, processor = tiny_vlm("llava", seed=0)
    vision, language = split_by_side(model)
    before = snapshot(model)
    module = SFTModule(model, processor.tokenizer, training={"optimizer": ADAMW})
    trainer = small_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=datamodule(processor, rows))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert not changed(before, model, vision) and changed(before, model, language)


def test_opd_fit_with_images(rows, tmp_path):
    student, teacher, processor = vlm_pair()
    vision, language = split_by_side(student)
    before = snapshot(student)
    module = OPDModule(
        student,
        teacher,
        processor.tokenizer,
        sampling={"max_new_tokens": 4},
        training={"optimizer": ADAMW},
        validation={"metrics": {}},
    )
    trainer = small_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=datamodule(processor, rows))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.sampling_calls == 2
    assert not changed(before, student, vision) and changed(before, student, language)


# -- refused before training ---------------------------------------------------------------------------------------
def test_a_text_teacher_with_image_rows_is_refused_before_training(rows, tmp_path):
    student, processor = tiny_vlm("llava", seed=0)
    tokenizer = processor.tokenizer
    text_teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)  # over the VLM tokenizer (its image token included)
    before = snapshot(student)
    module = gkd(student, text_teacher, processor, lmbda=0.0)
    with pytest.raises(ValueError, match="text model"):
        small_trainer(tmp_path, max_steps=1).fit(module, datamodule=datamodule(processor, rows))
    assert module.global_step == 0 and not changed(before, student, set(before))


def test_a_sampler_without_images_is_refused_before_training(rows, tmp_path):
    student, teacher, processor = vlm_pair()
    before = snapshot(student)
    module = gkd(
        student, teacher, processor, lmbda=1.0, sampling={"max_new_tokens": 4, "sampler": SpeculativeKDSampler}
    )
    with pytest.raises(ValueError, match="does not sample from prompts with images"):
        small_trainer(tmp_path, max_steps=1).fit(module, datamodule=datamodule(processor, rows))
    assert module.sampling_calls == 0 and not changed(before, student, set(before))


# -- several processes ---------------------------------------------------------------------------------------------
def run_worker(script: str, tmp_path) -> dict:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(HELPERS / script), str(out)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.multiprocess
def test_ddp_with_images_equals_one_process_with_the_doubled_batch(tmp_path):
    """2 gloo ranks x 2 shape rows per step (λ=0, SGD, 2 steps; the ranks' completion token counts differ) give the
    weights of one process training on the 4 rows of each step (the real loader at batch_size=4)."""
    r = run_worker("vlm_ddp_worker.py", tmp_path)
    assert r["world_size"] == 2 and r["backend"] == "gloo"
    frozen = r["frozen"]
    assert frozen["tokens"][0] != frozen["tokens"][1]  # uneven: the step's token mean spans both ranks
    assert frozen["doubled_rows_are_both_ranks"]
    assert frozen["vision_rows"] == [[2, 2], [2, 2]]  # each rank's batches carried one image dict per row
    assert frozen["weights_rank0_vs_rank1"] == 0.0
    assert frozen["vision_changed"] == 0.0  # frozen by default
    assert frozen["weights_changed"] > 1e-3 and frozen["weights_vs_doubled"] < 1e-6
    assert frozen["losses"] == pytest.approx(frozen["doubled_losses"], rel=1e-5)
    # training.freeze_vision=False (with find_unused_parameters=True: CLIP's post_layernorm gets no gradient)
    trained = r["vision_trained"]
    assert trained["doubled_rows_are_both_ranks"] and trained["weights_rank0_vs_rank1"] == 0.0
    assert trained["losses"] == pytest.approx(trained["doubled_losses"], rel=1e-5)
    assert trained["vision_changed"] > 1e-4 and trained["weights_vs_doubled"] < 1e-6


@pytest.mark.multiprocess
def test_fsdp2_sharded_vlm_steps_equal_the_unsharded_steps(tmp_path):
    """GKD steps with the llava student and teacher sharded by FSDP2 (ModelParallelStrategy, 2 gloo ranks; the vision
    tower and projector sit in the root unit), λ=0 and λ=1 (the sharded student samples with the images): per step,
    the token mean of the ranks' losses, and the trained weights, equal one unsharded process replaying both ranks'
    batches."""
    r = run_worker("vlm_fsdp_worker.py", tmp_path)
    assert r["strategy"] == "ModelParallelStrategy" and r["world_size"] == 2
    for case in ("dataset", "on_policy"):
        c = r[case]
        assert c["student_sharded"] and c["teacher_sharded"], case
        assert c["vision_rows"] == [2, 2, 2, 2], case  # 2 steps x 2 ranks, one image dict per row
        assert c["sharded_losses"] == pytest.approx(c["reference_losses"], rel=1e-5), case
        assert c["weights_vs_reference"] < 1e-6 and c["weights_changed"] > 1e-3, case
