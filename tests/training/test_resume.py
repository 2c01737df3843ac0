"""The Hydra run end to end: model card in the export, push_to_hub (HfApi replaced), and ckpt_path=last."""

import csv
import json
import os
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
from helpers.hydra_compose import compose_train
from huggingface_hub import constants
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_gkd.cli.hub import HubPushError
from lightning_gkd.cli.train import run
from lightning_gkd.training.checkpoint_io import CheckpointError
from lightning_gkd.training.resume import continue_csv_logs, fold_launch_folder, plan_resume, resolve_ckpt_path
from lightning_gkd.training.run_record import RunRecord, training_config

FAST = [
    "model=tiny",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.test_data=null",
    "method.sampling.max_new_tokens=4",
    "method.validation.max_new_tokens=4",
    "callbacks.held_out_eval=null",
    "callbacks.sample_table=null",
    "print_config=false",
    "~scheduler",
]


def compose_run(tmp_path: Path, name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose(
            "train", return_hydra_config=True, overrides=[f"paths.cache_dir={tmp_path / 'cache'}", *FAST, *overrides]
        )
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "outputs" / "runs" / name)
    return cfg


def train_losses(run_dir: Path) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]


class FakeApi:
    calls: list[tuple] = []

    def __init__(self, token=None):
        FakeApi.calls.append(("token", token))

    def create_repo(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_repo", repo_id, kwargs["private"]))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        FakeApi.calls.append(("upload_folder", kwargs["repo_id"], kwargs["folder_path"]))


@pytest.mark.slow
def test_card_push_and_resume_from_last(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_for_test")
    FakeApi.calls = []
    first = run(
        compose_run(
            tmp_path,
            "2026-01-01_00-00-00",
            ["trainer.max_steps=2", "push_to_hub=true", "hub_model_id=me/tiny-student", "hub_private_repo=true"],
        )
    )
    student = Path(first["student_dir"])
    card = (student / "README.md").read_text()
    assert "## Method: GKDModule" in card and "- lmbda: `0.5`" in card and "- steps: 2" in card
    assert f"- student: `{tmp_path / 'cache' / 'tiny-v1' / 'student'}`" in card
    assert "- teacher: `" in card and "lightning_gkd.toy.addition_rows(split=train)" in card
    assert "| val/loss |" in card and "hf_secret_for_test" not in card
    assert FakeApi.calls == [
        ("token", "hf_secret_for_test"),
        ("create_repo", "me/tiny-student", True),
        ("upload_folder", "me/tiny-student", str(student)),
    ]
    assert first["hub_url"] == "https://huggingface.co/me/tiny-student"
    first_ckpt = tmp_path / "outputs" / "runs" / "2026-01-01_00-00-00" / "checkpoints" / "last.ckpt"
    assert first_ckpt.is_file() and (first_ckpt.parent / "step2.ckpt").is_file()  # save_steps

    first_dir = first_ckpt.parents[1]
    record = json.loads((first_dir / "run.json").read_text())
    assert (record["status"], record["finished"], record["global_step"], record["max_steps"]) == (
        "finished",
        True,
        2,
        2,
    )

    second_dir = tmp_path / "outputs" / "runs" / "2026-01-01_00-05-00"
    # The same run again would train 0 steps and export again: refused, naming the run and the way on.
    with pytest.raises(CheckpointError, match=r"it finished \(step 2 of trainer.max_steps=2\)") as refused:
        run(compose_run(tmp_path, second_dir.name, ["trainer.max_steps=2", "ckpt_path=last"]))
    assert str(first_dir) in str(refused.value) and "raise trainer.max_steps above 2" in str(refused.value)

    # More steps extend it, in its own folder: logs, checkpoints and the export stay together.
    second = run(compose_run(tmp_path, second_dir.name, ["trainer.max_steps=4", "ckpt_path=last"]))
    assert second["resumed_from"] == str(first_ckpt) and second["run_dir"] == str(first_dir)
    assert second["global_step"] == 4
    assert train_losses(first_dir) == [0, 1, 2, 3]  # metrics.csv continued: the first fit's rows are kept
    assert not second_dir.exists()
    assert Path(second["student_dir"]) == first_dir / "student"
    assert "- resumed from: " in (Path(second["student_dir"]) / "README.md").read_text()
    assert torch.load(first_ckpt, weights_only=True)["global_step"] == 4
    record = json.loads((first_dir / "run.json").read_text())
    assert (record["status"], record["global_step"], record["max_steps"]) == ("finished", 4, 4)
    assert [resume["ckpt_path"] for resume in record["resumes"]] == [str(first_ckpt)]


def test_last_picks_the_most_recent_other_run_and_explains_when_none(tmp_path):
    runs = tmp_path / "runs"
    with pytest.raises(CheckpointError, match=r"ckpt_path=last: no earlier run under .*runs' has checkpoints/last"):
        resolve_ckpt_path("last", runs / "now")
    for index, name in enumerate(["b_old", "a_new", "now"]):
        path = runs / name / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (1000 + index, 1000 + index))
    os.utime(runs / "a_new" / "checkpoints" / "last.ckpt", (5000, 5000))
    assert resolve_ckpt_path("last", runs / "now") == str(runs / "a_new" / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path("some/file.ckpt", runs / "now") == "some/file.ckpt"
    assert resolve_ckpt_path(None, runs / "now") is None


def test_push_settings_are_checked_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cfg = compose_run(tmp_path, "x", ["trainer.max_steps=2", "push_to_hub=true", "hub_model_id=me/x"])
    with pytest.raises(HubPushError, match="HF_TOKEN"):
        run(cfg)
    assert not (tmp_path / "outputs" / "runs" / "x").exists()


# ckpt_path=last against run records, composed only (no training): runs under tmp/outputs/runs with a fake
# checkpoint file and the record a real fit would leave.
RUNS = ("outputs", "runs")


def fake_run(tmp_path: Path, name: str, overrides: list[str], *, status: str, step: int, mtime: float) -> Path:
    cfg = compose_train(tmp_path, overrides)
    run_dir = tmp_path.joinpath(*RUNS, name)
    record = RunRecord(run_dir, training_config(cfg), cfg.trainer.max_steps)
    record.started()
    record.ended(status, step)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"x")
    os.utime(ckpt, (mtime, mtime))
    return run_dir


def compose_in(tmp_path: Path, name: str, overrides: list[str]):
    cfg = compose_train(tmp_path, overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path.joinpath(*RUNS, name))
    return cfg


def test_last_refuses_a_run_trained_with_another_config_naming_the_keys(tmp_path):
    older = fake_run(tmp_path, "a", ["method.divergence.beta=0.0"], status="stopped", step=2, mtime=1000)
    newest = fake_run(
        tmp_path, "b", ["method.divergence.beta=0.5", "optimizer.lr=0.01"], status="stopped", step=2, mtime=2000
    )
    cfg = compose_in(tmp_path, "c", ["method.divergence.beta=0.0", "ckpt_path=last", "trainer.log_every_n_steps=3"])
    with pytest.raises(CheckpointError) as refused:
        plan_resume(cfg)
    message = str(refused.value)
    assert f"ckpt_path=last: refusing to resume the newest run, {newest}:" in message
    assert "    method.divergence.beta: 0.5 -> 0.0\n    optimizer.lr: 0.01 -> 0.001" in message
    assert "restore its values: method.divergence.beta=0.5 optimizer.lr=0.01" in message
    assert f"pass its checkpoint: ckpt_path={newest}/checkpoints/last.ckpt" in message
    assert f"An older run matches this config: ckpt_path={older}/checkpoints/last.ckpt" in message
    assert "log_every_n_steps" not in message  # printing cadence is not part of the training
    assert cfg.paths.output_dir == str(tmp_path.joinpath(*RUNS, "c"))  # unchanged


def test_last_resumes_into_the_run_folder_and_its_paths_follow(tmp_path, capsys):
    run_dir = fake_run(tmp_path, "a", ["method.divergence.beta=0.0"], status="stopped", step=2, mtime=1000)
    cfg = compose_in(tmp_path, "b", ["method.divergence.beta=0.0", "ckpt_path=last"])
    ckpt_path, record = plan_resume(cfg)
    assert ckpt_path == str(run_dir / "checkpoints" / "last.ckpt")
    assert record.run_dir == run_dir and record.launched_in == tmp_path.joinpath(*RUNS, "b")
    assert cfg.paths.output_dir == str(run_dir)
    # everything that interpolates ${paths.output_dir} follows (they resolve when instantiated)
    assert cfg.trainer.default_root_dir == str(run_dir)
    assert cfg.logger.csv.save_dir == str(run_dir)
    assert cfg.callbacks.model_checkpoint.dirpath == str(run_dir / "checkpoints")
    assert cfg.callbacks.signal_checkpoint.dirpath == str(run_dir / "checkpoints")
    assert f"resuming from {ckpt_path} into its run folder {run_dir}" in capsys.readouterr().out

    # Lightning's DDP launcher re-runs the command for the other ranks (same overrides, same Hydra folder) after
    # rank zero recorded the resume: they resolve the same checkpoint and folder.
    record.started()
    again = compose_in(tmp_path, "b", ["method.divergence.beta=0.0", "ckpt_path=last"])
    assert plan_resume(again)[0] == ckpt_path and again.paths.output_dir == str(run_dir)


def test_last_extends_a_finished_run_only_with_more_steps(tmp_path):
    # the cosine schedule's length is ${trainer.max_steps}: extending changes both, which is no config change
    fake_run(tmp_path, "a", ["trainer.max_steps=4"], status="finished", step=4, mtime=1000)
    for max_steps in (4, 3):
        with pytest.raises(CheckpointError, match=r"it finished \(step 4 of trainer.max_steps=4\)"):
            plan_resume(compose_in(tmp_path, "b", [f"trainer.max_steps={max_steps}", "ckpt_path=last"]))
    ckpt_path, _ = plan_resume(compose_in(tmp_path, "b", ["trainer.max_steps=8", "ckpt_path=last"]))
    assert ckpt_path.endswith("a/checkpoints/last.ckpt")


def test_last_refuses_a_run_already_past_max_steps(tmp_path):
    fake_run(tmp_path, "a", ["trainer.max_steps=100"], status="stopped", step=60, mtime=1000)
    with pytest.raises(CheckpointError, match=r"it is at step 60, at or past trainer.max_steps=50"):
        plan_resume(compose_in(tmp_path, "b", ["trainer.max_steps=50", "ckpt_path=last"]))


def test_a_run_without_a_record_resumes_with_a_warning(tmp_path):
    ckpt = tmp_path.joinpath(*RUNS, "old", "checkpoints", "last.ckpt")
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    (ckpt.parents[1] / ".hydra").mkdir()
    cfg = compose_in(tmp_path, "b", ["ckpt_path=last"])
    with pytest.warns(UserWarning, match=r"resuming .*old, which has no run.json \(made before"):
        assert plan_resume(cfg)[0] == str(ckpt)
    assert cfg.paths.output_dir == str(ckpt.parents[1])


def test_an_explicit_checkpoint_is_trusted_with_warnings(tmp_path):
    run_dir = fake_run(tmp_path, "a", ["method.divergence.beta=0.0"], status="finished", step=200, mtime=1000)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cfg = compose_in(tmp_path, "b", ["method.divergence.beta=1.0", f"ckpt_path={ckpt}"])
    with pytest.warns(UserWarning) as warned:
        assert plan_resume(cfg)[0] == str(ckpt)
    messages = [str(w.message) for w in warned]
    assert any(
        m.startswith(f"ckpt_path={ckpt}: resuming anyway") and "method.divergence.beta: 0.0 -> 1.0" in m
        for m in messages
    )
    assert any("it finished (step 200 of trainer.max_steps=200)" in m for m in messages)
    assert cfg.paths.output_dir == str(run_dir)
    # a checkpoint outside any run folder resumes into this launch's own folder
    loose = tmp_path / "old.ckpt"
    loose.write_bytes(b"x")
    cfg = compose_in(tmp_path, "c", [f"ckpt_path={loose}"])
    assert plan_resume(cfg)[0] == str(loose) and cfg.paths.output_dir == str(tmp_path.joinpath(*RUNS, "c"))


def test_csv_history_is_kept_up_to_the_checkpoint_step_and_hydra_files_join_the_run(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text("epoch,step,train/loss\n0,0,1.5\n0,1,1.25\n0,2,1.0\n0,3,0.75\n")
    logger = CSVLogger(tmp_path / "run", name="logs", version="")
    continue_csv_logs([logger], from_step=2)  # resuming from step2.ckpt: steps 2 and 3 are trained again
    logger.log_metrics({"train/loss": 0.9, "val/loss": 1.1}, step=2)
    logger.save()
    with open(logs / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["step"], row["train/loss"], row["val/loss"]) for row in rows] == [
        ("0", "1.5", ""),
        ("1", "1.25", ""),
        ("2", "0.9", "1.1"),
    ]

    launched = tmp_path / "runs" / "new"
    (launched / ".hydra").mkdir(parents=True)
    (launched / ".hydra" / "config.yaml").write_text("a: 1\n")
    (launched / "train.log").write_text("log\n")
    moved = fold_launch_folder(launched, tmp_path / "run")
    assert moved == tmp_path / "run" / "resumes" / "new" and not launched.exists()
    assert (moved / ".hydra" / "config.yaml").read_text() == "a: 1\n" and (moved / "train.log").is_file()


@pytest.mark.multiprocess
def test_ddp_ranks_resume_the_same_run_into_its_folder(tmp_path):
    """Lightning's DDP launcher re-runs the command (ckpt_path=last included) for rank 1 with rank 0's Hydra folder:
    both ranks must continue the same run in its folder, and the launch folder (rank 1's log too) joins it."""
    import subprocess
    import sys

    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "GROUP_RANK"))
    }
    common = [
        sys.executable,
        "-m",
        "lightning_gkd.cli.train",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "model=tiny",
        "paths.cache_dir=cache",
        *[item for item in FAST if item != "~scheduler"],
        "data.batch_size=8",
        "export=false",
    ]
    runs = tmp_path / "outputs" / "runs"
    for name, extra in (("a", ["trainer.max_steps=2"]), ("b", ["trainer.max_steps=4", "ckpt_path=last"])):
        done = subprocess.run(
            [*common, f"hydra.run.dir={runs / name}", *extra],
            cwd=tmp_path,
            env={**env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count(f"resuming from {runs / 'a' / 'checkpoints' / 'last.ckpt'} into its run folder") == 1
    assert "steps: 4 " in done.stdout
    assert [path.name for path in runs.iterdir()] == ["a"]
    assert train_losses(runs / "a") == [0, 1, 2, 3]  # rank 0 logs each step once; rank 1 trained alongside
    assert (runs / "a" / "resumes" / "b" / "train_ddp_process_1.log").is_file()  # rank 1 ran in b, now moved
    record = json.loads((runs / "a" / "run.json").read_text())
    assert (record["status"], record["global_step"], len(record["resumes"])) == ("finished", 4, 1)


def test_the_printed_config_of_a_resume_shows_the_run_folder_it_continues_in(tmp_path, capsys, monkeypatch):
    from lightning_gkd.cli.train import build

    monkeypatch.setenv("COLUMNS", "500")  # rich wraps at the terminal's width
    run_dir = fake_run(tmp_path, "a", ["method.divergence.beta=0.0"], status="stopped", step=2, mtime=1000)
    cfg = compose_in(tmp_path, "b", ["method.divergence.beta=0.0", "ckpt_path=last", "print_config=true"])
    with open_dict(cfg):
        cfg.pop("hydra", None)  # as @hydra.main hands it over
    build(cfg)
    printed = capsys.readouterr().out
    assert re.search(rf"output_dir: {re.escape(str(run_dir))}\s", printed), printed
    assert str(tmp_path.joinpath(*RUNS, "b")) not in printed.split("resuming from", 1)[-1]


def test_a_resume_continues_the_mlflow_run_it_started(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first_dir = tmp_path / "outputs" / "runs" / "a"
    run(compose_run(tmp_path, "a", ["trainer.max_steps=2", "logger=mlflow"]))
    run_id = json.loads((first_dir / "run.json").read_text())["tracking"]["mlflow"]
    run(compose_run(tmp_path, "b", ["trainer.max_steps=4", "logger=mlflow", "ckpt_path=last"]))
    assert f"continuing the mlflow run {run_id}" in capsys.readouterr().out
    client = MlflowClient(f"file:{first_dir / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "lightning-gkd"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])  # one run, not one per launch
    assert mlflow_run.info.run_id == run_id
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0, 1, 2, 3]
    assert json.loads((first_dir / "run.json").read_text())["tracking"] == {"mlflow": run_id}


def test_a_resume_points_wandb_and_mlflow_at_the_recorded_runs_unless_an_id_is_given(tmp_path):
    from lightning_gkd.cli.trainer_setup import logger_entries
    from lightning_gkd.training.run_record import continue_tracking_runs

    cfg = compose_in(tmp_path, "b", ["logger=[csv,wandb,mlflow]"])
    record = {"tracking": {"wandb": "abc123", "mlflow": "0f9e"}}
    continued = continue_tracking_runs(logger_entries(cfg.logger), record)
    assert continued == ["wandb run abc123", "mlflow run 0f9e"]
    assert (cfg.logger.wandb.id, cfg.logger.wandb.resume, cfg.logger.mlflow.run_id) == ("abc123", "allow", "0f9e")
    given = compose_in(tmp_path, "c", ["logger=wandb", "+logger.wandb.id=mine"])
    assert continue_tracking_runs(logger_entries(given.logger), record) == []
    assert given.logger.wandb.id == "mine"
    assert continue_tracking_runs(logger_entries(cfg.logger), None) == []
