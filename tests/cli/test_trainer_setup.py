"""The trainer settings a run's output depends on: intervals clamped to max_steps, the progress bar, the loggers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.hydra_compose import compose_train
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

import lightning_gkd.cli.train as train_cli
from lightning_gkd.cli.trainer_setup import clamp_intervals, instantiate_loggers, logger_entries, prepare_trainer


def test_a_run_shorter_than_the_validation_interval_validates_and_checkpoints_at_its_end(tmp_path, capsys):
    cfg = compose_train(tmp_path, ["trainer.max_steps=30"])  # val_check_interval 50, log_every_n_steps 10
    clamp_intervals(cfg)
    assert cfg.trainer.val_check_interval == 30 and cfg.trainer.log_every_n_steps == 10
    assert cfg.callbacks.model_checkpoint.every_n_train_steps == 30  # ${trainer.val_check_interval}
    assert cfg.callbacks.sample_table.every_n_steps == 30
    assert capsys.readouterr().out == (
        "trainer.val_check_interval=50 is more than trainer.max_steps=30: validating (and checkpointing) at step 30 "
        "instead.\n"
    )
    short = compose_train(tmp_path, ["trainer.max_steps=3"])
    clamp_intervals(short)
    assert (short.trainer.val_check_interval, short.trainer.log_every_n_steps) == (3, 3)


def test_nothing_to_clamp(tmp_path, capsys):
    for overrides in (["trainer.max_steps=200"], ["trainer.max_steps=-1"], ["trainer.val_check_interval=0.5"]):
        cfg = compose_train(tmp_path, overrides)
        before = (cfg.trainer.val_check_interval, cfg.trainer.log_every_n_steps)
        clamp_intervals(cfg)
        assert (cfg.trainer.val_check_interval, cfg.trainer.log_every_n_steps) == before
    assert capsys.readouterr().out == ""


def test_a_list_of_logger_options_makes_one_logger_each(tmp_path):
    cfg = compose_train(tmp_path, ["logger=[csv,tensorboard]"])
    loggers = instantiate_loggers(cfg.logger)
    assert [type(logger) for logger in loggers] == [CSVLogger, TensorBoardLogger]
    assert Path(loggers[0].log_dir) == tmp_path / "run" / "logs"
    assert Path(loggers[1].log_dir) == tmp_path / "run" / "tensorboard"
    assert [type(x) for x in instantiate_loggers(compose_train(tmp_path, ["logger=csv"]).logger)] == [CSVLogger]
    assert instantiate_loggers(compose_train(tmp_path, ["logger=none"]).logger) == []
    assert instantiate_loggers(compose_train(tmp_path, ["~logger"]).get("logger")) == []
    # a logger config from before the entries were named: one {_target_: ...}
    old = compose_train(tmp_path, []).logger.csv
    assert list(logger_entries(old)) == ["logger"] and isinstance(instantiate_loggers(old)[0], CSVLogger)


@pytest.mark.parametrize("choice, package, extra", [("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")])
def test_a_missing_logger_package_fails_before_any_model_loads(choice, package, extra, tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "lightning_gkd.cli.trainer_setup.importlib.util.find_spec",
        lambda name, *args: None if name == package else real_find_spec(name, *args),
    )
    built = []
    monkeypatch.setattr(train_cli, "build", lambda cfg: built.append(cfg))
    cfg = compose_train(tmp_path, [f"logger=[csv,{choice}]", "print_config=false"])
    with pytest.raises(ModuleNotFoundError) as error:
        train_cli.run(cfg)
    assert str(error.value) == (
        f"logger={choice} needs the `{package}` package, which is not installed: pip install "
        f"'lightning-gkd[{extra}]' (or pip install {package}), or choose another logger (logger=csv, "
        "logger=tensorboard, logger=none)."
    )
    assert built == []


def test_a_disabled_progress_bar_drops_the_progress_callback(tmp_path):
    # Lightning refuses a ProgressBar callback with enable_progress_bar=False
    cfg = compose_train(tmp_path, ["+trainer.enable_progress_bar=false", "logger=none"])
    assert prepare_trainer(cfg) is False
    assert cfg.callbacks.progress is None and cfg.callbacks.learning_rate is not None
    trainer = instantiate(cfg.trainer, callbacks=train_cli.instantiate_callbacks(cfg.callbacks), logger=False)
    assert trainer.progress_bar_callback is None
