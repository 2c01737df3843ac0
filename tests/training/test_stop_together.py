"""Stopping a fit so that no rank waits forever: a teacher outage during validation and a non-finite loss stop every
rank together, with one checkpoint to resume from and one message saying how (``training.teacher_outage``,
``training.nonfinite``).

The single-process pieces run here: the agreement in one process (no collective), the messages, the checkpoint saved
from inside a validation (recorded as a validation not begun, so the resumed run validates again) and the one saved
before a non-finite step. The 2-process runs (gloo, CPU; ``tests/helpers/stop_together_ddp_worker.py``) check that
both ranks stop at once, raise the same error naming the failing rank, write one checkpoint, and resume from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.fitting import fit, logged, make_module, small_trainer
from helpers.launch import clean_env
from helpers.paths import HELPERS

from lightning_gkd import ChatDataModule
from lightning_gkd.teachers import LocalTeacher, TeacherUnavailable
from lightning_gkd.teachers.base import TeacherBase
from lightning_gkd.training.nonfinite import NonFiniteGuard, NonFiniteLoss, NonFiniteStop
from lightning_gkd.training.teacher_outage import (
    failed_ranks,
    mark_validation_unstarted,
    stop_ranks_together,
)

#: seconds a 2-process run may take before the test kills it (a rank left waiting would otherwise hang CI)
LAUNCH_TIMEOUT_S = 150


def one_process() -> L.Trainer:
    """A stand-in trainer of one process: any collective on it would fail (it has no strategy)."""
    return SimpleNamespace(world_size=1, global_rank=0)  # type: ignore[return-value]


# -- the agreement in one process -------------------------------------------------------------------------------------
def test_in_one_process_the_agreements_need_no_collective():
    assert failed_ranks(True, one_process()) == [0] and failed_ranks(torch.tensor(False), one_process()) == []
    stop_ranks_together(TeacherUnavailable("down"), one_process())  # the caller re-raises its own failure
    guard = NonFiniteGuard("raise")
    guard.check_ranks(torch.tensor(float("nan")), 3, one_process())  # ``check`` decides in one process
    with pytest.raises(NonFiniteLoss, match=r"Non-finite training loss \(nan\) at global step 3"):
        guard.check(torch.tensor(float("nan")), 3)


def rank_1_of_2(other_message: str | None = None) -> L.Trainer:
    """A stand-in trainer of rank 1 of 2 whose all-reduce sums its flag with rank 0's (0: rank 0 is fine)."""
    strategy = SimpleNamespace(root_device=torch.device("cpu"), reduce=lambda flags, reduce_op: flags)
    return SimpleNamespace(world_size=2, global_rank=1, strategy=strategy)  # type: ignore[return-value]


def test_the_ranks_agreed_message_names_the_failing_rank_and_its_model(monkeypatch):
    def gather(messages, message):  # rank 0's loss was finite: it has nothing to say
        messages[:] = [None, message]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    assert failed_ranks(torch.tensor(True), rank_1_of_2()) == [1]
    guard = NonFiniteGuard("raise")
    guard.record_flag("student", torch.tensor(False))
    guard.check_ranks(torch.tensor(2.0), 5, rank_1_of_2())  # finite here (and on rank 0): nothing happens
    with pytest.raises(NonFiniteLoss) as raised:
        guard.check_ranks(torch.tensor(float("nan")), 5, rank_1_of_2())
    assert str(raised.value).startswith(
        "Rank 1 of 2: Non-finite training loss (nan) at global step 5: the student produced non-finite logits "
        "(NaN or inf). All 2 ranks stopped together, before this step's update: the model was not updated with it."
    )
    with pytest.raises(TeacherUnavailable, match=r"^rank 1 of 2: down; all 2 ranks stopped together, in validation$"):
        stop_ranks_together(TeacherUnavailable("down"), rank_1_of_2(), where="in validation")


def test_the_non_finite_message_names_the_model_and_stays_a_runtime_error():
    guard = NonFiniteGuard("raise")
    guard.record_flag("student", torch.tensor(False))
    guard.record_flag("teacher", torch.tensor(True))
    assert guard.problem(torch.tensor(1.0), 0) is None
    assert guard.problem(torch.tensor(float("inf")), 7) == (
        "Non-finite training loss (inf) at global step 7: the student produced non-finite logits (NaN or inf)."
    )
    with pytest.raises(RuntimeError, match="The model was not updated with it") as raised:
        guard.check(torch.tensor(float("nan")), 7)
    assert isinstance(raised.value, NonFiniteLoss) and raised.value.before_update


def test_a_checkpoint_saved_in_validation_records_a_validation_not_begun():
    """Two of this validation's batches were done and the third failed: recorded as none done, one in flight, so
    Lightning restarts "mid-evaluation" from the loader's first batch with clean counters."""
    progress = {
        "total": {"ready": 7, "started": 7, "processed": 6, "completed": 6},
        "current": {"ready": 3, "started": 3, "processed": 2, "completed": 2},
        "is_last_batch": False,
    }
    checkpoint = {"loops": {"fit_loop": {"epoch_loop.val_loop.batch_progress": progress}}}
    mark_validation_unstarted(checkpoint)
    assert progress["current"] == {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    assert progress["total"] == {"ready": 5, "started": 5, "processed": 4, "completed": 4}


# -- one process: the checkpoints and the resumes ---------------------------------------------------------------------
class ValidationOutage(TeacherBase):
    """A sparse teacher over a real model that is down while ``down["on"]``."""

    def __init__(self, model: torch.nn.Module, down: dict[str, bool]) -> None:
        self.inner, self.top_k, self.down = LocalTeacher(model, top_k=64), 64, down

    def topk(self, batch, positions):
        if self.down["on"]:
            raise TeacherUnavailable("http://127.0.0.1:1: stayed down after 4 attempts")
        return self.inner.topk(batch, positions)


class Validations(L.Callback):
    """Records (global step, validation batches) of each validation of the fit, and stops the teacher after the
    first validation batch at step ``down_at`` (when given)."""

    def __init__(self, down: dict[str, bool] | None = None, down_at: int | None = None) -> None:
        self.seen: list[tuple[int, int]] = []
        self.down, self.down_at = down, down_at

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.seen.append((trainer.global_step, 0))

    def on_validation_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.sanity_checking:
            return
        self.seen[-1] = (trainer.global_step, self.seen[-1][1] + 1)
        if self.down is not None and trainer.global_step == self.down_at:
            self.down["on"] = True


def test_a_teacher_outage_in_validation_saves_the_step_and_the_resume_validates_again(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    initial = {k: v.clone() for k, v in student.state_dict().items()}

    def module(down: dict[str, bool]):
        model = type(student)(student.config)
        model.load_state_dict(initial)
        return make_module(model, ValidationOutage(teacher, down), tokenizer, lmbda=0.0, divergence={"beta": 0.0})

    settings = {"limit_val_batches": 3, "val_check_interval": 2, "num_sanity_val_steps": 0}
    down = {"on": False}
    seen = Validations(down, down_at=2)  # the second of step 2's validation batches fails
    with pytest.warns(UserWarning, match=r"Stopped in the validation after step 2; saved .*last\.ckpt") as warned:
        with pytest.raises(TeacherUnavailable):
            fit(module(down), tokenizer, toy_rows, tmp_path / "broken", max_steps=4, callbacks=[seen], **settings)
    assert sum("is unavailable" in str(w.message) for w in warned) == 1
    assert seen.seen == [(2, 1)]
    saved = tmp_path / "broken" / "checkpoints" / "last.ckpt"
    assert torch.load(saved, weights_only=True)["global_step"] == 2
    again = Validations()
    data = ChatDataModule(tokenizer, toy_rows["train"], toy_rows["val"], batch_size=4, max_length=64)
    resumed = small_trainer(tmp_path / "resumed", csv=True, max_steps=4, callbacks=[again], **settings)
    resumed.fit(module({"on": False}), datamodule=data, ckpt_path=saved, weights_only=True)
    assert again.seen == [(2, 3), (4, 3)]  # step 2's whole validation again, then training on to step 4
    assert resumed.global_step == 4 and len(logged(tmp_path / "resumed", "train/loss")) == 2


def test_a_non_finite_loss_saves_the_state_before_the_step_and_a_resume_trains_on(
    student, teacher, tokenizer, toy_rows, tmp_path
):
    module = make_module(student, teacher, tokenizer, lmbda=0.0)
    poisoned = {"on": False}

    def hook(model, args, output):
        if poisoned["on"]:
            output.last_hidden_state[0] = float("nan")

    handle = module.student.get_decoder().register_forward_hook(hook)

    class PoisonAt(L.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            poisoned["on"] = trainer.global_step == 2

    data = ChatDataModule(tokenizer, toy_rows["train"], batch_size=4, max_length=64)
    with pytest.warns(UserWarning, match=r"Stopped on a non-finite loss before step 3; saved .*last\.ckpt, the state"):
        with pytest.raises(NonFiniteLoss, match=r"at global step 2: the student produced non-finite logits"):
            small_trainer(tmp_path, max_steps=4, callbacks=[PoisonAt()]).fit(module, datamodule=data)
    saved = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(saved, weights_only=True)
    assert state["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    handle.remove()
    resumed = small_trainer(tmp_path / "resumed", max_steps=4)
    resumed.fit(module, datamodule=data, ckpt_path=saved)
    assert resumed.global_step == 4
    assert any(isinstance(c, NonFiniteStop) for c in resumed.callbacks)  # type: ignore[attr-defined]


# -- two processes ----------------------------------------------------------------------------------------------------
def run_two_ranks(scenario: str, out) -> tuple[list[dict], str]:
    """Run ``stop_together_ddp_worker.py <scenario> <out>`` (2 gloo ranks); each rank's result and the logs. A run
    past ``LAUNCH_TIMEOUT_S`` (a rank left waiting) is killed with its whole process group and fails the test."""
    worker = subprocess.Popen(
        [sys.executable, str(HELPERS / "stop_together_ddp_worker.py"), scenario, str(out)],
        cwd=out.parent,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # rank 1 is its child: killed with it on a hang
    )
    try:
        logs, _ = worker.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        logs, _ = worker.communicate()
        pytest.fail(f"the 2-process run hung past {LAUNCH_TIMEOUT_S} s: {logs[-3000:]}")
    assert worker.returncode == 0, logs[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)], logs


@pytest.mark.multiprocess
def test_a_teacher_outage_in_validation_on_one_ddp_rank_stops_every_rank_together(tmp_path):
    """Rank 1's teacher server stops after its first validation batch at step 2. Without the agreement rank 0 waits
    in validation's metric sync until the process group's timeout (30 s there). With it both raise
    TeacherUnavailable naming rank 1 within seconds, one checkpoint holds step 2, and the resumed run validates
    step 2 again and trains to max_steps."""
    out = tmp_path / "run"
    started = time.perf_counter()
    ranks, logs = run_two_ranks("validation_outage", out)
    saved = out / "checkpoints" / "last.ckpt"
    for rank in ranks:
        stop = rank["stop"]
        assert stop["error"] == "TeacherUnavailable", rank  # not the gloo timeout of a rank left waiting
        assert stop["message"].startswith("rank 1 of 2: The teacher server at http://127.0.0.1:"), stop
        assert "rank 0 of 2" not in stop["message"] and stop["message"].endswith("stopped together, in validation")
        assert stop["global_step"] == 2 and stop["seconds"] < 25, stop  # at once, not after the 30 s timeout
        assert stop["saved"] == str(saved)
        assert rank["resume"]["error"] is None and rank["resume"]["global_step"] == 4, rank
        assert rank["resume"]["validations"] == [[2, 2], [4, 2]]  # step 2's validation again, all of it
    assert ranks[0]["stop"]["validations"] == ranks[1]["stop"]["validations"] == [[2, 1]]  # both stop in batch 2
    assert ranks[0]["saved_step"] == 2 and ranks[0]["checkpoints"] == [str(saved)]
    assert logs.count("The teacher server is unavailable (rank 1 of 2:") == 1, logs[-4000:]
    assert logs.count(f"resume with ckpt_path={saved}") == 1
    assert time.perf_counter() - started < LAUNCH_TIMEOUT_S


@pytest.mark.multiprocess
def test_a_non_finite_loss_on_one_ddp_rank_stops_every_rank_together(tmp_path):
    """Rank 1's student logits turn NaN at step 2. Without the agreement rank 1 raises alone and rank 0 goes on to
    backward's gradient all-reduce. With it both raise NonFiniteLoss naming rank 1 and the student within seconds,
    one checkpoint holds the state before step 3 (step 2, nothing updated), and a resume trains on to max_steps."""
    out = tmp_path / "run"
    ranks, logs = run_two_ranks("nonfinite", out)
    saved = out / "checkpoints" / "last.ckpt"
    for rank in ranks:
        stop = rank["stop"]
        assert stop["error"] == "NonFiniteLoss", rank
        assert stop["message"].startswith(
            "Rank 1 of 2: Non-finite training loss (nan) at global step 2: the student produced non-finite logits"
        ), stop
        assert "Rank 0 of 2" not in stop["message"] and "All 2 ranks stopped together" in stop["message"]
        assert stop["global_step"] == 2 and stop["seconds"] < 25, stop
        assert stop["saved"] == str(saved)
        assert rank["resume"]["error"] is None and rank["resume"]["global_step"] == 4, rank
    assert ranks[0]["saved_step"] == 2 and ranks[0]["saved_finite"] and ranks[0]["checkpoints"] == [str(saved)]
    assert logs.count("Stopped on a non-finite loss before step 3; saved") == 1, logs[-4000:]
