"""SIGTERM / SIGUSR1 during training: the step finishes, a checkpoint is saved, the run stops cleanly (status 0),
and resuming from that checkpoint continues to max_steps. Ctrl-C (SIGINT) likewise (status 130), and a second one
aborts. The tests that send SIGINT give the process receiving it Python's default handler: a test run started as a
background job of a script inherits SIGINT ignored, and the callback leaves an ignored SIGINT ignored (it logs so)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import lightning as L
import pytest
import torch
from helpers.fitting import small_trainer
from helpers.paths import ROOT
from helpers.signals import child_default_sigint, signal_after_first_checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.callbacks.signal_checkpoint import SignalCheckpoint, ctrl_c_notice
from lightning_gkd.training.checkpoint_io import SafeCheckpointIO


@pytest.fixture
def default_sigint():
    """Python's default SIGINT handler (KeyboardInterrupt) for the test, whatever this process inherited."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class SendSignal(L.Callback):
    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def fit(student, teacher, tokenizer, rows, tmp_path, callbacks, max_steps, ckpt_path=None):
    module = GKDModule(
        student,
        teacher,
        tokenizer,
        lmbda=0.5,
        sampling={"max_new_tokens": 4},
        training={"optimizer": partial(torch.optim.AdamW, lr=1e-3)},
    )
    trainer = small_trainer(
        tmp_path, max_steps=max_steps, enable_checkpointing=True, plugins=[SafeCheckpointIO()], callbacks=callbacks
    )
    trainer.fit(
        module, datamodule=ChatDataModule(tokenizer, rows["train"], batch_size=4, max_length=64), ckpt_path=ckpt_path
    )
    return trainer


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=["SIGTERM", "SIGUSR1", "SIGINT"]
)
def test_signal_saves_a_checkpoint_at_a_step_boundary_and_resume_continues(
    student, teacher, tokenizer, toy_rows, tmp_path, signum, caplog, capsys, default_sigint
):
    saver = SignalCheckpoint(tmp_path / "checkpoints")
    handlers_before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    caplog.set_level("INFO")
    with pytest.raises(SIGTERMException) as stopped:
        fit(student, teacher, tokenizer, toy_rows, tmp_path, [SendSignal(signum, at_step=2), saver], max_steps=6)
    assert stopped.value.code is None  # a SystemExit that exits with status 0
    assert {s: signal.getsignal(s) for s in handlers_before} == handlers_before  # nothing left installed
    assert saver.saved_path == tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(saver.saved_path, weights_only=True)
    assert checkpoint["global_step"] == 2
    name = signal.Signals(signum).name
    assert f"Received {name}: stopped after step 2 and saved {saver.saved_path}. Resume with ckpt_path=" in caplog.text
    assert saver.run_summary()["stop_signal"] == name
    notice = "Ctrl-C: stopping after the current training step and saving a checkpoint to resume from. Press Ctrl-C"
    assert (notice in capsys.readouterr().err) == (signum == signal.SIGINT)

    resumed = fit(
        student, teacher, tokenizer, toy_rows, tmp_path / "resumed", [], max_steps=4, ckpt_path=saver.saved_path
    )
    assert resumed.global_step == 4


class SendTwice(L.Callback):
    """Two Ctrl-Cs during step ``at_step``'s training step: the second must not wait for the step to end."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("the second Ctrl-C did not abort at once")


def test_a_second_ctrl_c_aborts_at_once_without_saving(
    student, teacher, tokenizer, toy_rows, tmp_path, capsys, default_sigint
):
    saver = SignalCheckpoint(tmp_path / "checkpoints")
    with pytest.raises(SystemExit) as aborted:  # Lightning's KeyboardInterrupt handling: exit status 1
        fit(student, teacher, tokenizer, toy_rows, tmp_path, [saver, SendTwice(at_step=2)], max_steps=6)
    assert aborted.value.code == 1
    assert saver.saved_path is None and not (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored after fit
    assert "Press Ctrl-C again to abort at once" in capsys.readouterr().err


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_the_callback_logs_once_whether_ctrl_c_stops_the_run(
    student, teacher, tokenizer, toy_rows, tmp_path, caplog, inherited
):
    handler = signal.SIG_IGN if inherited == "ignored" else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, handler)
    try:
        caplog.set_level("INFO")
        saver = SignalCheckpoint(tmp_path / "checkpoints")
        fit(student, teacher, tokenizer, toy_rows, tmp_path, [saver], max_steps=1)
        fit(student, teacher, tokenizer, toy_rows, tmp_path / "again", [saver], max_steps=1)
        assert signal.getsignal(signal.SIGINT) == handler  # an ignored SIGINT stays ignored
    finally:
        signal.signal(signal.SIGINT, previous)
    notices = [r.getMessage() for r in caplog.records if "Ctrl-C" in r.getMessage()]
    assert notices == [ctrl_c_notice(handler, os.getpid())]  # once, though two fits
    if inherited == "ignored":
        assert notices[0].startswith("Ctrl-C will not stop this run: SIGINT is ignored in this process")
        assert f"send SIGTERM: kill -TERM {os.getpid()}" in notices[0] and "( trap - INT; cmd ) &" in notices[0]
    else:
        assert notices[0] == "Ctrl-C stops the run after the current training step with a checkpoint to resume from."


@pytest.mark.slow
def test_the_ctrl_c_tests_pass_when_started_with_sigint_ignored():
    """The in-process Ctrl-C tests run in a pytest started as a script's background job would be: SIGINT ignored."""
    tests = [
        f"{__file__}::test_signal_saves_a_checkpoint_at_a_step_boundary_and_resume_continues[SIGINT]",
        f"{__file__}::test_a_second_ctrl_c_aborts_at_once_without_saving",
        f"{__file__}::test_the_callback_logs_once_whether_ctrl_c_stops_the_run",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,  # the repository root: this checkout's package
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_a_signal_before_the_first_step_saves_nothing(student, teacher, tokenizer, toy_rows, tmp_path):
    class DuringSanityCheck(L.Callback):
        def on_validation_batch_end(self, trainer, *args):
            if trainer.sanity_checking:
                os.kill(os.getpid(), signal.SIGTERM)

    saver = SignalCheckpoint(tmp_path / "checkpoints")
    trainer = small_trainer(
        tmp_path,
        max_steps=3,
        enable_checkpointing=True,
        limit_val_batches=1.0,
        num_sanity_val_steps=2,
        callbacks=[saver, DuringSanityCheck()],
    )
    data = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4, val_batch_size=4)
    with pytest.raises(SIGTERMException):
        trainer.fit(GKDModule(student, teacher, tokenizer, sampling={"max_new_tokens": 4}), datamodule=data)
    assert trainer.global_step == 0
    assert saver.saved_path is None and not (tmp_path / "checkpoints" / "last.ckpt").exists()


COMMON = [
    sys.executable,
    "-m",
    "lightning_gkd.cli.train",
    "model=tiny",
    "paths.cache_dir=cache",
    "print_config=false",
    "trainer.limit_val_batches=0",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "data.batch_size=4",
    "method.sampling.max_new_tokens=4",
    "trainer.log_every_n_steps=1",
]


@pytest.mark.slow
def test_sigterm_to_the_command_line_run_saves_exits_0_and_resumes(tmp_path):
    """The real thing: `python -m lightning_gkd.cli.train` in a subprocess, SIGTERM once it has trained a few steps."""
    common = COMMON
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
    # continued in the run's own folder, not restarted: one training row per step, the first fit's rows kept
    assert trained_steps(run_dir) == list(range(step + 3))
    assert (run_dir / "student" / "model.safetensors").is_file()
    assert not (tmp_path / "resumed").exists() and (run_dir / "resumes" / "resumed" / ".hydra").is_dir()


def trained_steps(run_dir) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.mark.slow
def test_ctrl_c_on_the_command_line_saves_exits_130_and_ckpt_path_last_finishes(tmp_path):
    """A real `python -m lightning_gkd.cli.train`, Ctrl-C (SIGINT) once it has trained a few steps, then
    `ckpt_path=last` from a new launch: the run ends at max_steps in its own folder, every step trained once."""
    run_dir, log = tmp_path / "outputs" / "runs" / "a", tmp_path / "first_run.log"
    command = [*COMMON, f"hydra.run.dir={run_dir}", "trainer.max_steps=100000"]
    process = signal_after_first_checkpoint(
        [*command, "callbacks.model_checkpoint.every_n_train_steps=2"],
        cwd=tmp_path,
        run_dir=run_dir,
        log=log,
        signum=signal.SIGINT,
    )
    output = log.read_text()
    assert process.returncode == 130, output[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    assert "Ctrl-C: stopping after the current training step" in output
    assert f"Received SIGINT: stopped after step {step} and saved {last}" in output
    assert f"stopped by Ctrl-C (SIGINT) after step {step}, before the end: not exported" in output
    assert f"resume with: ckpt_path={last}" in output and not (run_dir / "student").exists()
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["status"], record["finished"], record["global_step"]) == ("stopped", False, step)

    resumed = subprocess.run(
        [*COMMON, f"hydra.run.dir={tmp_path}/outputs/runs/b", f"trainer.max_steps={step + 2}", "ckpt_path=last"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {last} into its run folder {run_dir}" in resumed.stdout
    assert f"steps: {step + 2} " in resumed.stdout  # as many steps as an uninterrupted run
    assert trained_steps(run_dir) == list(range(step + 2))
    assert (run_dir / "student" / "model.safetensors").is_file()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"


SLOW_STEP = """
import pathlib, time
import lightning as L

class SlowStep(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 1:
            pathlib.Path("in_slow_step").write_text("")
            time.sleep(120)
"""


@pytest.mark.slow
def test_a_second_ctrl_c_on_the_command_line_aborts_without_waiting_for_the_step(tmp_path):
    (tmp_path / "slow_step.py").write_text(SLOW_STEP)  # a module in the launch folder: importable by the run
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [
                *COMMON,
                f"hydra.run.dir={run_dir}",
                "trainer.max_steps=10",
                "+callbacks.slow._target_=slow_step.SlowStep",
            ],
            cwd=tmp_path,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=child_default_sigint,
        )
        try:
            deadline = time.monotonic() + 180
            while not (tmp_path / "in_slow_step").exists():  # step 2 has started and takes 120 s
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "step 2 did not start within 180 s"
                time.sleep(0.2)
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            sent = time.monotonic()
            process.wait(timeout=60)
            took = time.monotonic() - sent
        finally:
            if process.poll() is None:
                process.kill()
    output = log.read_text()
    assert process.returncode == 1, output[-3000:]
    assert took < 60 and "Press Ctrl-C again to abort at once without saving" in output
    assert "Detected KeyboardInterrupt" in output and "Received SIGINT" not in output
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


@pytest.mark.multiprocess
def test_ctrl_c_under_ddp_stops_every_rank_after_the_same_step(tmp_path):
    """A terminal's Ctrl-C reaches every process of the foreground group (here: rank 0 and the rank 1 Lightning
    started). The ranks agree on the stop step; had they not, the checkpoint's barrier would hang or fail."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "GROUP_RANK"))
    }
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [
                *COMMON,
                "trainer=ddp",
                "trainer.devices=2",
                "trainer.accelerator=cpu",
                f"hydra.run.dir={run_dir}",
                "trainer.max_steps=100000",
                "callbacks.model_checkpoint.every_n_train_steps=2",
            ],
            cwd=tmp_path,
            env={**env, "OMP_NUM_THREADS": "1"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job
            preexec_fn=child_default_sigint,
        )
        try:
            deadline = time.monotonic() + 240
            while not list((run_dir / "checkpoints").glob("step*.ckpt")):
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no training step within 240 s"
                time.sleep(0.2)
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert process.returncode == 130, output[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert output.count(f"Received SIGINT: stopped after step {step} and saved") == 1  # rank zero reports
    assert output.count("Ctrl-C: stopping after the current training step") == 1
