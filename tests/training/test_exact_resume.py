"""Exact resume through the Hydra entry point: a run stopped by SIGTERM after step 5 and resumed with
ckpt_path=last repeats the uninterrupted run's losses, coin flips and on-policy samples exactly (CPU), with
grouped generation (k=2, so the stop falls inside a group) and a learning-rate schedule."""

from pathlib import Path

import pytest
from helpers.fitting import per_step
from helpers.hydra_compose import compose_train

from lightning_gkd.cli.train import run

pytestmark = pytest.mark.slow  # three full CLI runs per test (whole, stopped, resumed)

OVERRIDES = [
    "model=tiny",
    "trainer.max_steps=10",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.steps_per_generation=2",
    "data.test_data=null",
    "method.lmbda=0.5",
    "method.sampling.max_new_tokens=6",
    "method.validation.max_new_tokens=4",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
    "export=false",
    "scheduler.num_warmup_steps=2",
]


def compose(tmp_path: Path, name: str, extra: list[str]):
    cfg = compose_train(tmp_path, [*OVERRIDES, *extra])
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / name)
    return cfg


def test_sigterm_then_ckpt_path_last_repeats_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(compose(tmp_path, "a_full", []))
    full = tmp_path / "outputs" / "runs" / "a_full"

    stopped = run(
        compose(
            tmp_path,
            "b_stopped",
            ["+callbacks.sigterm._target_=helpers.signals.SigtermAt", "+callbacks.sigterm.step=5"],
        )
    )
    stopped_dir = tmp_path / "outputs" / "runs" / "b_stopped"
    assert (stopped_dir / "checkpoints" / "last.ckpt").exists()
    assert sorted(per_step(stopped_dir, "train/loss")) == list(range(0, 5))
    run(compose(tmp_path, "c_resumed", ["ckpt_path=last"]))  # continues in b_stopped, its run folder
    assert per_step(stopped_dir, "train/loss") == per_step(full, "train/loss")  # every step's loss, bit for bit
    flips = per_step(full, "train/on_policy")
    assert per_step(stopped_dir, "train/on_policy") == flips
    assert 0 < sum(flips.values()) < 10
    # the sampled completions' lengths (on-policy steps: the student's samples) match step for step too
    assert per_step(stopped_dir, "train/completion_length") == per_step(full, "train/completion_length")
    assert stopped["stopped_by_signal"] and stopped["global_step"] == 5


def test_dpo_resumes_mid_epoch_exactly(tmp_path, monkeypatch):
    """The preference DataModule uses the same resumable loader: DPO stopped after step 4 continues identically.
    (Stopped on a validation step instead, the losses still match but Lightning logs the resumed steps one number
    higher: it restores a checkpoint saved after that step's validation as if it had been saved before it.)"""
    monkeypatch.chdir(tmp_path)
    dpo = [
        "method=dpo",
        "data=toy_preference",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "data.batch_size=4",
        "data.val_batch_size=4",
        "callbacks.held_out_eval=null",
        "callbacks.sample_table=null",
        "print_config=false",
        "export=false",
    ]

    def compose_dpo(name, extra):
        cfg = compose_train(tmp_path, [*dpo, *extra])
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / name)
        return cfg

    run(compose_dpo("a_full", []))
    stopped = run(
        compose_dpo(
            "b_stopped",
            ["+callbacks.sigterm._target_=helpers.signals.SigtermAt", "+callbacks.sigterm.step=4"],
        )
    )
    assert stopped["stopped_by_signal"] and stopped["global_step"] == 4
    run(compose_dpo("c_resumed", ["ckpt_path=last"]))
    runs = tmp_path / "outputs" / "runs"
    expected = per_step(runs / "a_full", "train/loss")
    assert len(expected) == 6
    assert per_step(runs / "b_stopped", "train/loss") == expected  # resumed into b_stopped, its run folder
