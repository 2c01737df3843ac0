"""The run record (lightning_gkd/training/run_record.py): which config values count as "the training", and what
run.json holds across a fit and a resume."""

import json

import pytest
from helpers.hydra_compose import compose_train
from lightning.pytorch.utilities import rank_zero_only

from lightning_gkd.training.run_record import (
    MISSING,
    RunRecord,
    config_diff,
    fingerprint,
    restoring_override,
    training_config,
)


def test_the_fingerprint_covers_what_changes_training_only(tmp_path):
    base = training_config(compose_train(tmp_path, []))
    assert base["method.divergence.beta"] == 0.5 and base["trainer.precision"] == "32-true" and base["seed"] == 42
    # the length of the run, where it writes, what it prints or logs, evaluation-only knobs: not the training
    for override in [
        "trainer.max_steps=7",
        "print_config=false",
        "trainer.log_every_n_steps=3",
        "trainer.val_check_interval=5",
        "callbacks.sample_table=null",
        "logger=tensorboard",
        "export=false",
        "method.validation.max_new_tokens=3",
        "data.val_batch_size=2",
        "trainer.accelerator=gpu",
    ]:
        assert training_config(compose_train(tmp_path, [override])) == base, override
    # the scheduler's length follows trainer.max_steps: recorded as the placeholder, not the number
    assert base["scheduler.num_training_steps"] == "<trainer.max_steps>"
    for override in [
        "method.divergence.beta=0.1",
        "optimizer.lr=0.01",
        "seed=1",
        "data.batch_size=8",
        "trainer.precision=bf16-mixed",
        "trainer.accumulate_grad_batches=2",
        "trainer.devices=2",
        "teacher.top_k=20",
        "scheduler=linear",
    ]:
        changed = training_config(compose_train(tmp_path, [override]))
        assert fingerprint(changed) != fingerprint(base), override


def test_the_diff_and_the_overrides_that_restore_it():
    diff = config_diff({"a": 1, "b": "x y", "gone": True}, {"a": 2, "b": "x y", "new": None})
    assert diff == [("a", 1, 2), ("gone", True, MISSING), ("new", MISSING, None)]
    assert [restoring_override(*item) for item in diff] == ["a=1", "+gone=true", "~new"]
    assert restoring_override("data.train_data", "my data/x.jsonl", "y") == 'data.train_data="my data/x.jsonl"'
    assert restoring_override("model.student.name_or_path", "Qwen/Qwen2.5-0.5B", "x").endswith("=Qwen/Qwen2.5-0.5B")


def test_run_json_across_a_fit_and_a_resume(tmp_path, monkeypatch):
    config = {"method.divergence.beta": 0.5}
    first = RunRecord(tmp_path, config, 4)
    first.started()
    record = json.loads((tmp_path / "run.json").read_text())
    assert (record["status"], record["finished"], record["global_step"], record["max_steps"]) == (
        "running",
        False,
        0,
        4,
    )
    assert record["fingerprint"] == fingerprint(config) and record["config"] == config and record["resumes"] == []
    first.ended("finished", 4)
    assert json.loads((tmp_path / "run.json").read_text())["finished"] is True

    resumed = RunRecord(tmp_path, {"method.divergence.beta": 0.25}, 8, ckpt_path="c.ckpt", launched_in=tmp_path / "new")
    resumed.started()
    resumed.ended("stopped", 6)
    record = json.loads((tmp_path / "run.json").read_text())
    assert (record["status"], record["finished"], record["global_step"], record["max_steps"]) == (
        "stopped",
        False,
        6,
        8,
    )
    assert record["config"] == {"method.divergence.beta": 0.25}  # the config it is now trained with
    (resume,) = record["resumes"]
    assert resume["ckpt_path"] == "c.ckpt" and resume["changed"] == {"method.divergence.beta": [0.5, 0.25]}
    assert resume["launched_in"] == str(tmp_path / "new")

    monkeypatch.setattr(rank_zero_only, "rank", 1)  # other ranks never write
    RunRecord(tmp_path / "other", config, 4).started()
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_an_unfinished_fit_is_not_finished(tmp_path, status):
    record = RunRecord(tmp_path, {}, 4)
    record.started()
    record.ended(status, 2)
    assert json.loads((tmp_path / "run.json").read_text())["finished"] is False


def test_inline_rows_are_recorded_by_digest_and_unresolvable_values_as_written(tmp_path):
    from omegaconf import open_dict

    cfg = compose_train(tmp_path, ["+note=${oc.env:LIGHTNING_GKD_TEST_UNSET_VARIABLE}"])
    with open_dict(cfg):
        cfg.data.train_data = [{"messages": [{"role": "user", "content": "x" * 50}]}] * 40
    config = training_config(cfg)
    assert config["note"] == "${oc.env:LIGHTNING_GKD_TEST_UNSET_VARIABLE}"
    assert config["data.train_data"].startswith("sha256:") and len(json.dumps(config)) < 20_000
    with open_dict(cfg):
        cfg.data.train_data[0] = {"messages": []}
    assert training_config(cfg)["data.train_data"] != config["data.train_data"]
