"""StudyRecord (lightning_gkd/callbacks/study_record.py): the estimated FLOPs of each counted call, and what a real
fit records: the curve and compute at each validation, the tokens, the completions of the trained model, its start
and its teacher."""

import json
from types import SimpleNamespace

import torch
from helpers.fitting import fit, make_module

from lightning_gkd.callbacks.study_record import ComputeMeter, StudyRecord, folder_parameter_count, parameter_count
from lightning_gkd.evaluation.metrics import exact_match
from lightning_gkd.toy import addition_rows
from lightning_gkd.toy.tiny import asset_path

STUDENT = torch.nn.Linear(2, 3)  # 9 parameters
TEACHER = torch.nn.Linear(4, 4)  # 20 parameters


def stand_in(*, teacher=None, teacher_source=None, stats=None, on_policy=True):
    """A method as the meter sees it: its models, loss and sampling call, and the sampler's last figures."""
    calls = []
    module = SimpleNamespace(model=STUDENT, teacher=teacher, teacher_source=teacher_source, training=True)
    if on_policy:
        module.training_loss = lambda batch: calls.append(("loss", batch)) or "loss"
        module.sample_batch = lambda model, batch, seed: calls.append(("sample", seed)) or batch["sampled"]
        module.sampler = SimpleNamespace(last_stats=lambda: dict(stats or {}))
    else:
        module.completion_loss = lambda batch: "loss"
    return module, calls


def batch(trained: int, prompt: int = 4, new: int = 3) -> dict:
    labels = torch.full((1, prompt + new), -100)
    labels[0, prompt:] = 1
    return {
        "attention_mask": torch.ones(1, trained),
        "prompt_attention_mask": torch.ones(1, prompt),
        "sampled": {"labels": labels},
    }


def test_training_tokens_cost_six_student_flops_and_two_teacher_flops_each():
    module, calls = stand_in(teacher=TEACHER)
    meter = ComputeMeter()
    meter.attach(module)
    assert module.training_loss(batch(trained=5)) == "loss" and [name for name, _ in calls] == ["loss"]
    assert meter.flops == 6 * 9 * 5 + 2 * 20 * 5
    assert meter.tokens == {"generated": 0, "teacher_scored": 5, "trained": 5}
    module.training = False  # validation's loss is not training compute
    module.training_loss(batch(trained=5))
    assert meter.flops == 6 * 9 * 5 + 2 * 20 * 5


def test_sampling_costs_two_flops_of_the_sampling_model_per_token_read_or_written():
    module, _ = stand_in(teacher=TEACHER)
    meter = ComputeMeter()
    meter.attach(module)
    module.sample_batch(STUDENT, batch(trained=0), seed=1)  # 4 prompt + 3 new tokens through the student
    assert meter.flops == 2 * 9 * 7 and meter.tokens["generated"] == 3
    module.sample_batch(TEACHER, batch(trained=0), seed=2)  # seq_kd: the teacher samples
    assert meter.flops == 2 * 9 * 7 + 2 * 20 * 7 and meter.tokens["generated"] == 6


def test_speculative_sampling_counts_the_drafts_and_the_teachers_verification():
    module, _ = stand_in(teacher=TEACHER, stats={"teacher_tokens_per_token": 2.0, "student_tokens_per_token": 1.5})
    meter = ComputeMeter()
    meter.attach(module)
    module.sample_batch(STUDENT, batch(trained=0, new=4), seed=0)
    assert meter.flops == 2 * 9 * 6 + 2 * 20 * 8  # round(1.5 x 4) drafted, round(2 x 4) verified
    assert meter.tokens["teacher_verified"] == 8


def test_a_served_teacher_counts_as_its_parameters_and_sft_has_no_teacher():
    module, _ = stand_in(teacher_source=object())  # teacher=server: no model in the process
    meter = ComputeMeter()
    meter.attach(module, served_teacher=100)
    module.training_loss(batch(trained=2))
    assert meter.flops == 6 * 9 * 2 + 2 * 100 * 2
    sft, _ = stand_in(on_policy=False)
    meter = ComputeMeter()
    meter.attach(sft, served_teacher=100)
    sft.completion_loss(batch(trained=2))
    assert meter.flops == 6 * 9 * 2 and meter.tokens["teacher_scored"] == 0


def test_a_folder_is_counted_without_loading_it():
    folder = asset_path("toy/teacher")
    from lightning_gkd.models.loading import load_causal_lm

    assert folder_parameter_count(folder) == parameter_count(load_causal_lm(folder))


def test_a_real_fit_records_its_curve_compute_and_completions(tokenizer, student, teacher, tmp_path):
    rows = {"train": addition_rows("train", 16), "val": addition_rows("val", 8), "test": addition_rows("test", 6)}
    scoring = {"max_length": 64, "max_new_tokens": 6, "completions": True, "reference": True}
    record = StudyRecord({"name": "GKD λ=1"}, task="addition", seed=3, lr=0.01, **scoring)
    validation = {"metrics": {"accuracy": exact_match}, "max_new_tokens": 6}
    module = make_module(student, teacher, tokenizer, lmbda=1.0, validation=validation)
    fit(
        module, tokenizer, rows, tmp_path, max_steps=4, val_check_interval=2, num_sanity_val_steps=1, callbacks=[record]
    )
    saved = json.loads(json.dumps(record.run_summary()["study"]))  # JSON-ready
    assert [step for step, _ in saved["curve"]] == [2, 4]  # the sanity check is not a point
    assert [step for step, _, _ in saved["compute"]] == [2, 4]
    (_, half, seconds_half), (_, flops, seconds) = saved["compute"]
    assert 0 < half < flops == saved["train_flops"] and 0 < seconds_half < seconds == saved["train_seconds"]
    tokens = saved["tokens"]
    assert tokens["generated"] > 0 and tokens["teacher_scored"] == tokens["trained"] > tokens["generated"]
    assert saved["settings"] == {"steps": 4, "batch_size": 4, "eval_every": 2, "train_rows": 16}
    assert (saved["recipe"], saved["task"], saved["seed"], saved["lr"]) == ({"name": "GKD λ=1"}, "addition", 3, 0.01)
    assert set(saved["completions"]) == {"trained", "student_init", "teacher"}
    for who in ("trained", "student_init", "teacher"):
        assert len(saved["completions"][who]["greedy"]["texts"]) == 6
        assert len(saved["completions"][who]["sampled"]["texts"]) == 6
    assert 0 <= saved["completions"]["student_init"]["val_accuracy"] <= 1
    assert "train/loss" in saved["metrics"] and saved["length_guard_alerts"] == []
