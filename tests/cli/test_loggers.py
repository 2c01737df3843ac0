"""logger=[csv,tensorboard], logger=wandb (offline) and logger=mlflow (a file store in the run folder), end to end.
The W&B and MLflow tests skip where their packages (the wandb and mlflow extras, both in dev) are not installed."""

from __future__ import annotations

import csv
import os

import pytest
from helpers.hydra_compose import FAST, compose_train

import lightning_gkd.cli.train as train_cli
from lightning_gkd.cli.trainer_setup import close_loggers, instantiate_loggers

RUN = [*FAST, "model=tiny", "callbacks.held_out_eval=null", "callbacks.sample_table=null", "export=false"]


def test_csv_and_tensorboard_together(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_cli.run(compose_train(tmp_path, [*RUN, "logger=[csv,tensorboard]"]))
    with open(tmp_path / "run" / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows if r.get("train/loss")] == [0, 1, 2]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert {"train/loss", "train/lr", "val/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2]
    csv_lr = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx(csv_lr)


@pytest.mark.slow
def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # WandbLogger(offline=True) sets it too; restored after the test
    monkeypatch.setenv("WANDB_SILENT", "true")
    summaries = []

    def close_and_keep_summary(loggers, failed=False):
        summaries.extend(dict(logger.experiment.summary) for logger in loggers if hasattr(logger, "_wandb_init"))
        close_loggers(loggers, failed)

    monkeypatch.setattr(train_cli, "close_loggers", close_and_keep_summary)
    cfg = compose_train(tmp_path, [*RUN, "logger=wandb", "logger.wandb.offline=true", "logger.wandb.name=toy"])
    result = train_cli.run(cfg)

    (summary,) = summaries
    assert summary["train/loss"] == pytest.approx(result["metrics"]["train/loss"])
    assert summary["val/loss"] == pytest.approx(result["metrics"]["val/loss"])
    assert summary["train/lr"] == pytest.approx(result["metrics"]["train/lr"])
    assert summary["trainer/global_step"] == 2  # the train metrics' last logged step (0-based)
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    # WandbLogger's anonymous=None made wandb warn "The anonymous setting has no effect ..." on every run
    assert "anonymous" not in instantiate_loggers(cfg.logger)[0]._wandb_init
    assert list(folder.glob("run-*.wandb"))
    assert wandb.run is None  # the run ended with the job: the next job in this process gets its own


def test_mlflow_to_a_file_store_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # unset now, and unset again after the test
    result = train_cli.run(compose_train(tmp_path, [*RUN, "logger=mlflow"]))
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # MLflow 3 refuses its file store without it

    client = MlflowClient(f"file:{tmp_path / 'run' / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "lightning-gkd"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    losses = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [0, 1, 2]
    assert losses[-1].value == pytest.approx(result["metrics"]["train/loss"])
    assert len(client.get_metric_history(mlflow_run.info.run_id, "train/lr")) == 3
    assert mlflow_run.data.params["lmbda"] == "0.5"  # the method's hyperparameters
