"""SIGTERM / SIGUSR1 during training: the step finishes, a checkpoint is saved, the run stops cleanly (status 0),
and resuming from that checkpoint continues to max_steps."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.callbacks.signal_checkpoint import SignalCheckpoint
from lightning_gkd.training.checkpoint_io import SafeCheckpointIO


class SendSignal(L.Callback):
    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def fit(student, teacher, tokenizer, rows, tmp_path, callbacks, max_steps, ckpt_path=None):
    module = GKDModule(
        student, teacher, tokenizer, lmbda=0.5, max_new_tokens=4, optimizer=partial(torch.optim.AdamW, lr=1e-3)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        plugins=[SafeCheckpointIO()],
        callbacks=callbacks,
    )
    trainer.fit(
        module, datamodule=ChatDataModule(tokenizer, rows["train"], batch_size=4, max_length=64), ckpt_path=ckpt_path
    )
    return trainer


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_a_checkpoint_at_a_step_boundary_and_resume_continues(
    student, teacher, tokenizer, toy_rows, tmp_path, signum, caplog
):
    saver = SignalCheckpoint(tmp_path / "checkpoints")
    handlers_before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    caplog.set_level("INFO")
    with pytest.raises(SIGTERMException) as stopped:
        fit(student, teacher, tokenizer, toy_rows, tmp_path, [saver, SendSignal(signum, at_step=2)], max_steps=6)
    assert stopped.value.code is None  # a SystemExit that exits with status 0
    assert {s: signal.getsignal(s) for s in handlers_before} == handlers_before  # nothing left installed
    assert saver.saved_path == tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(saver.saved_path, weights_only=True)
    assert checkpoint["global_step"] == 2
    name = signal.Signals(signum).name
    assert f"Received {name}: stopped after step 2 and saved {saver.saved_path}. Resume with ckpt_path=" in caplog.text

    resumed = fit(
        student, teacher, tokenizer, toy_rows, tmp_path / "resumed", [], max_steps=4, ckpt_path=saver.saved_path
    )
    assert resumed.global_step == 4


def test_a_signal_before_the_first_step_saves_nothing(student, teacher, tokenizer, toy_rows, tmp_path):
    class DuringSanityCheck(L.Callback):
        def on_validation_batch_end(self, trainer, *args):
            if trainer.sanity_checking:
                os.kill(os.getpid(), signal.SIGTERM)

    saver = SignalCheckpoint(tmp_path / "checkpoints")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2,
        default_root_dir=tmp_path,
        callbacks=[saver, DuringSanityCheck()],
    )
    data = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4, val_batch_size=4)
    with pytest.raises(SIGTERMException):
        trainer.fit(GKDModule(student, teacher, tokenizer, max_new_tokens=4), datamodule=data)
    assert trainer.global_step == 0
    assert saver.saved_path is None and not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_sigterm_to_the_command_line_run_saves_exits_0_and_resumes(tmp_path):
    """The real thing: `python -m lightning_gkd.cli.train` in a subprocess, SIGTERM once it has trained a few steps."""
    common = [
        sys.executable,
        "-m",
        "lightning_gkd.cli.train",
        "model=tiny",
        f"paths.cache_dir={tmp_path}/cache",
        "print_config=false",
        "trainer.limit_val_batches=0",
        "callbacks.held_out_eval=null",
        "callbacks.sample_table=null",
        "data.batch_size=4",
        "method.max_new_tokens=4",
        "trainer.log_every_n_steps=1",
    ]
    run_dir, log = tmp_path / "run", tmp_path / "first_run.log"
    with open(log, "w") as sink:  # a file, not a pipe: a full pipe would block the run
        process = subprocess.Popen(
            [
                *common,
                f"hydra.run.dir={run_dir}",
                "trainer.max_steps=100000",
                "callbacks.model_checkpoint.every_n_train_steps=2",
            ],
            cwd=tmp_path,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 180
            while not list((run_dir / "checkpoints").glob("step*.ckpt")):  # it has done at least two steps
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no training step within 180 s"
                time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    output = log.read_text()
    assert process.returncode == 0, output[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    assert step >= 2
    assert f"Received SIGTERM: stopped after step {step} and saved {last}" in output
    assert f"resume with: ckpt_path={last}" in output and "not exported" in output
    assert not (run_dir / "student").exists()

    resumed = subprocess.run(
        [*common, f"hydra.run.dir={tmp_path}/resumed", f"trainer.max_steps={step + 3}", f"ckpt_path={last}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"steps: {step + 3} " in resumed.stdout
    with open(tmp_path / "resumed" / "logs" / "metrics.csv") as handle:
        steps = sorted({int(row["step"]) for row in csv.DictReader(handle)})
    assert steps and steps[0] >= step  # continued, not restarted
    assert (tmp_path / "resumed" / "student" / "model.safetensors").is_file()
