"""GKDModule trained with a plain Lightning Trainer (no Hydra), as a user's own project would."""

from functools import partial

import pytest
import torch
from helpers.fitting import LossOf, fit, logged, make_module
from transformers import AutoModelForCausalLM

from lightning_gkd import GKDModule
from lightning_gkd.losses import DistillationLoss
from lightning_gkd.models.loading import load_causal_lm
from lightning_gkd.toy.tiny import TINY_STUDENT

#: What a step logs on a batch of the student's own samples (lightning_gkd.losses.base.sample_figures).
SAMPLE_FIGURES = {
    "agreement": "train/teacher_top1_agreement",
    "mass": "train/teacher_mass_on_student_top5",
    "entropy": "train/student_entropy",
}


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "lmbda, seq_kd, expected_source", [(0.0, False, "dataset"), (1.0, False, "student"), (0.0, True, "teacher")]
)
def test_fit_trains_student_only(
    student, teacher, tokenizer, toy_rows, tmp_path, monkeypatch, lmbda, seq_kd, expected_source
):
    module = make_module(student, teacher, tokenizer, lmbda=lmbda, seq_kd=seq_kd)
    sampled_by = []
    original = GKDModule.sample_batch
    monkeypatch.setattr(
        GKDModule,
        "sample_batch",
        lambda self, model, batch, seed: (
            sampled_by.append("student" if model is self.student else "teacher") or original(self, model, batch, seed)
        ),
    )
    student_before, teacher_before = snapshot(module.student), snapshot(module.teacher)

    trainer = fit(module, tokenizer, toy_rows, tmp_path)

    assert trainer.global_step == 3
    assert sampled_by == ([] if expected_source == "dataset" else [expected_source] * 3)
    assert any(not torch.equal(v, student_before[k]) for k, v in module.student.state_dict().items())
    assert all(torch.equal(v, teacher_before[k].to(v.dtype)) for k, v in module.teacher.state_dict().items())
    assert not module.teacher.training and module.student.training
    losses = logged(tmp_path, "train/loss")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))) and all(x > 0 for x in losses)
    assert logged(tmp_path, "train/on_policy") == [float(expected_source == "student")] * 3
    # the sample figures only where the student sampled the completions
    for key in SAMPLE_FIGURES.values():
        assert len(logged(tmp_path, key)) == (3 if expected_source == "student" else 0), key
    # toy completions are 1-4 digits + "<|im_end|>\n"; samples are capped at max_new_tokens=6
    assert all(1 <= x <= 6 for x in logged(tmp_path, "train/completion_length"))
    assert len(logged(tmp_path, "val/loss")) == 1

    (checkpoint_path,) = (tmp_path / "checkpoints").glob("*.ckpt")
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    assert checkpoint["state_dict"] and not any(k.startswith("teacher.") for k in checkpoint["state_dict"])
    assert all(k.startswith("model.") for k in checkpoint["state_dict"])


def test_checkpoint_reloads_strictly_without_teacher_keys(student, teacher, tokenizer, toy_rows, tmp_path):
    module = make_module(student, teacher, tokenizer, lmbda=0.0)
    trainer = fit(module, tokenizer, toy_rows, tmp_path, max_steps=2)
    path = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(path)
    fresh = make_module(
        load_causal_lm({"config": {**TINY_STUDENT, "vocab_size": len(tokenizer)}}), module.teacher, tokenizer
    )
    loaded = type(fresh).load_from_checkpoint(path, student=fresh.student, teacher=fresh.teacher, tokenizer=tokenizer)
    for key, value in module.student.state_dict().items():
        assert torch.equal(loaded.student.state_dict()[key], value)
    assert loaded.hparams.lmbda == 0.0


def test_export_loads_with_auto_model_and_gives_the_same_logits(student, teacher, tokenizer, tmp_path):
    module = make_module(student, teacher, tokenizer)
    target = module.export(tmp_path / "student")
    module.export(tmp_path / "student")  # overwriting an export replaces it whole
    reloaded = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = torch.tensor([[1, 87, 85, 71, 84, 201, 19, 13]])
    module.student.eval()
    torch.testing.assert_close(reloaded(ids).logits, module.student(ids).logits, rtol=0, atol=0)
    assert (target / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]


def test_coin_flip_is_a_function_of_seed_step_and_batch(student, teacher, tokenizer):
    a = make_module(student, teacher, tokenizer, lmbda=0.5, training={"seed": 7})
    b = make_module(student, teacher, tokenizer, lmbda=0.5, training={"seed": 7})
    c = make_module(student, teacher, tokenizer, lmbda=0.5, training={"seed": 8})
    flips_a = [a.choose_source(i) for i in range(400)]
    torch.manual_seed(123)  # the global RNG plays no part
    assert flips_a == [b.choose_source(i) for i in range(400)]
    assert flips_a != [c.choose_source(i) for i in range(400)]
    on_policy = flips_a.count("student") / 400
    assert 0.4 < on_policy < 0.6 and set(flips_a) == {"student", "dataset"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lmbda": 1.5}, r"lmbda must be in \[0, 1\], got 1.5"),
        ({"divergence": {"beta": -0.1}}, r"beta must be in \[0, 1\], got -0.1"),
        ({"sampling": {"temperature": 0.0}}, "temperature must be > 0, got 0.0"),
        ({"divergence": {"loss_temperature": -1.0}}, "loss_temperature must be > 0"),
        ({"sampling": {"max_new_tokens": 0}}, "max_new_tokens must be >= 1, got 0"),
        ({"sampling": {"top_p": 0.0}}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_invalid_hyperparameters_fail_at_construction(student, teacher, tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_module(student, teacher, tokenizer, **kwargs)


def test_vocab_mismatch_fails_before_training(student, tokenizer):
    teacher = load_causal_lm({"config": {**TINY_STUDENT, "vocab_size": 300}})
    with pytest.raises(ValueError, match="Student vocabulary size 259 differs from the teacher's 300"):
        make_module(student, teacher, tokenizer)


def test_scheduler_steps_every_optimizer_step(student, teacher, tokenizer, toy_rows, tmp_path):
    scheduler = partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: 1.0 / (1 + step))
    module = make_module(
        student,
        teacher,
        tokenizer,
        lmbda=0.0,
        training={"scheduler": scheduler, "optimizer": partial(torch.optim.SGD, lr=0.1)},
    )
    trainer = fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / 4)


class MeanLogProbLoss(DistillationLoss):
    """A loss of one's own: minus the student's mean log-prob of the completion tokens, counted per row (not per
    token), with a value of its own logged."""

    def __init__(self, teacher, scale: float = 1.0) -> None:
        self.teacher, self.scale = teacher, scale

    def __call__(self, student, batch):
        from lightning_gkd.losses import Logged, LossOutput

        logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        log_probs = logits.float().log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        per_row = (log_probs * (labels != -100)).sum(1) / (labels != -100).sum(1).clamp_min(1)
        rows = torch.tensor(batch["input_ids"].shape[0])
        return LossOutput(-self.scale * per_row.mean(), rows, {"mine": Logged(per_row.detach().mean(), float(rows))})


def test_a_loss_object_of_ones_own_trains_with_its_count_and_logs(student, teacher, tokenizer, toy_rows, tmp_path):
    from lightning_gkd.teachers import LocalTeacher

    module = make_module(student, teacher, tokenizer, lmbda=0.0, loss=partial(MeanLogProbLoss, scale=2.0))
    assert isinstance(module.loss, MeanLogProbLoss) and module.loss.scale == 2.0
    assert isinstance(module.loss.teacher, LocalTeacher) and module.loss.teacher.model is module.teacher
    counts = []
    original = module.token_normalizer.micro_batch_loss
    module.token_normalizer.micro_batch_loss = lambda loss, n: counts.append(int(n)) or original(loss, n)
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    assert counts == [4, 4, 4]  # the step normaliser weighs each micro-batch by the loss's own count (rows)
    mine, losses = logged(tmp_path, "train/mine"), logged(tmp_path, "train/loss")
    assert len(mine) == 3 and losses == pytest.approx([-2 * value for value in mine], rel=1e-5)
    assert len(logged(tmp_path, "val/mine")) == 1
    built = MeanLogProbLoss(LocalTeacher(teacher))
    assert make_module(student, teacher, tokenizer, loss=built).loss is built  # an object is used as it is
    spec = {"kind": "multi", "teachers": {"a": {"kind": "local", "model": teacher}}}
    with pytest.raises(ValueError, match=r"A loss factory .* teacher\.kind=multi has several: pass a built loss"):
        make_module(student, spec, tokenizer, loss=MeanLogProbLoss)


def test_on_policy_steps_log_the_figures_of_the_students_samples(tokenizer, toy_rows, tmp_path):
    """λ = 1 with the toy teacher and its student start: each step logs the teacher's top-1 agreement with the
    sampled tokens, its mass on the student's top-5 and the student's entropy, as a float64 reference computes them
    from both models' full logits on the very batch the step trains on, at the weights it trains."""
    from helpers.sample_figures import reference_figures

    from lightning_gkd.losses import STUDENT_SAMPLES
    from lightning_gkd.ops.hf.model_inputs import causal_lm_logits
    from lightning_gkd.teachers import next_tokens, supervised_positions
    from lightning_gkd.toy.tiny import asset_path

    student, teacher = load_causal_lm(asset_path("toy/student_init")), load_causal_lm(asset_path("toy/teacher"))
    module = make_module(
        student, teacher, tokenizer, lmbda=1.0, sampling={"max_new_tokens": 8}, training={"frozen_dtype": "float32"}
    )
    references = []
    loss = module.loss

    def recording(model, batch):
        positions = supervised_positions(batch["labels"])
        with torch.no_grad():
            logits = [causal_lm_logits(m, batch)[positions] for m in (model, module.teacher)]
        figures = reference_figures(*logits, next_tokens(batch["input_ids"], positions))
        references.append((batch.get(STUDENT_SAMPLES, False), figures))
        return loss(model, batch)

    module.loss = LossOf(recording)
    fit(module, tokenizer, toy_rows, tmp_path, max_steps=3)
    # the sanity check's validation batch, three steps, the last validation (dataset completions: unflagged)
    assert [flag for flag, _ in references] == [False, True, True, True, False]
    steps = [figures for flag, figures in references if flag]
    for name, key in SAMPLE_FIGURES.items():
        assert logged(tmp_path, key) == pytest.approx([r[name] for r in steps], abs=1e-5), key
    agreement = logged(tmp_path, SAMPLE_FIGURES["agreement"])
    assert all(0.0 < value < 1.0 for value in agreement)  # the student's samples: the teacher disagrees at times


def test_a_loss_of_ones_own_must_be_a_distillation_loss(student, teacher, tokenizer):
    """The method calls every loss object's check_datamodule and close: a loss subclasses DistillationLoss (whose
    hooks do nothing), and anything else is refused naming the base class."""
    with pytest.raises(TypeError, match=r"GKDModule\(loss=\.\.\.\) takes a lightning_gkd\.losses\.DistillationLoss"):
        make_module(student, teacher, tokenizer, loss=lambda student, batch: None)
    loss = MeanLogProbLoss(None)
    loss.check_datamodule(object())  # the base's hooks: nothing to check, nothing to close
    loss.close()
    assert make_module(student, teacher, tokenizer, loss=loss).loss is loss
