"""The trainer's settings a run's output depends on: intervals clamped to ``max_steps``, the progress bar, and the
loggers (``logger=csv``, ``logger=[csv,tensorboard]``, ``logger=wandb``, ``logger=mlflow``, ``logger=null``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

# Logger class -> (the module it imports, the lightning-gkd extra that installs it).
LOGGER_PACKAGES = {"WandbLogger": ("wandb", "wandb"), "MLFlowLogger": ("mlflow", "mlflow")}


def prepare_trainer(cfg: DictConfig) -> list[Logger] | bool:
    """Adjust ``cfg`` before the Trainer is built (``clamp_intervals``; no progress-bar callback when
    ``trainer.enable_progress_bar=false``) and return its loggers (False for none)."""
    clamp_intervals(cfg)
    if cfg.trainer.get("enable_progress_bar") is False and cfg.get("callbacks"):
        for name, entry in cfg.callbacks.items():
            if entry is not None and "_target_" in entry and issubclass(get_class(entry._target_), ProgressBar):
                cfg.callbacks[name] = None  # Lightning refuses a progress bar callback with the bar disabled
    return instantiate_loggers(cfg.get("logger")) or False


def clamp_intervals(cfg: DictConfig) -> None:
    """A run shorter than ``trainer.val_check_interval`` never validates (nor checkpoints: model_checkpoint's
    ``every_n_train_steps`` is the same number); one shorter than ``log_every_n_steps`` never logs its train metrics.
    Both become ``trainer.max_steps`` then."""
    trainer = cfg.trainer
    max_steps = trainer.get("max_steps")
    if not isinstance(max_steps, int) or max_steps <= 0:
        return
    every = trainer.get("val_check_interval")
    if isinstance(every, int) and not isinstance(every, bool) and every > max_steps:
        trainer.val_check_interval = max_steps
        _info(
            f"trainer.val_check_interval={every} is more than trainer.max_steps={max_steps}: validating (and "
            f"checkpointing) at step {max_steps} instead."
        )
    log_every = trainer.get("log_every_n_steps")
    if isinstance(log_every, int) and log_every > max_steps:
        trainer.log_every_n_steps = max_steps


def logger_entries(cfg_logger: Any) -> dict[str, DictConfig]:
    """name -> logger config: each named entry of the ``logger`` group (``csv: {_target_: ...}``), or a single
    ``{_target_: ...}`` as ``logger`` (a config written before the loggers were named)."""
    if not cfg_logger:
        return {}
    if "_target_" in cfg_logger:
        return {"logger": cfg_logger}
    return {name: entry for name, entry in cfg_logger.items() if entry is not None and "_target_" in entry}


def check_logger_packages(cfg_logger: Any) -> None:
    """Fail before any model loads when a chosen logger's package is not installed, naming the pip extra."""
    for name, entry in logger_entries(cfg_logger).items():
        package, extra = LOGGER_PACKAGES.get(str(entry._target_).rsplit(".", 1)[-1], (None, None))
        if package is not None and importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(
                f"logger={name} needs the `{package}` package, which is not installed: "
                f"pip install 'lightning-gkd[{extra}]' (or pip install {package}), or choose another logger "
                "(logger=csv, logger=tensorboard, logger=none)."
            )


def instantiate_loggers(cfg_logger: Any) -> list[Logger]:
    """The configured loggers, in the order the ``logger`` group lists them."""
    check_logger_packages(cfg_logger)
    loggers = []
    for entry in logger_entries(cfg_logger).values():
        uri = str(entry.get("tracking_uri") or "")
        if str(entry._target_).endswith("MLFlowLogger") and uri.startswith("file:"):
            # MLflow 3 refuses its file store unless this is set ("maintenance mode"); a run folder's own
            # mlruns/ needs no database or server. An explicit MLFLOW_ALLOW_FILE_STORE stays as it is.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        logger = instantiate(entry)
        init = getattr(logger, "_wandb_init", None)
        if isinstance(init, dict) and init.get("anonymous", 0) is None:
            # WandbLogger passes anonymous=None, which wandb >= 0.2x warns about on every run ("The anonymous
            # setting has no effect ..."); None is wandb's default anyway.
            del init["anonymous"]
        loggers.append(logger)
    return loggers


def close_loggers(loggers: list[Logger], failed: bool = False) -> None:
    """End what a logger keeps open past ``trainer.fit``: the W&B run (else the next run in this process, a Hydra
    multirun job, would log into it)."""
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger" and getattr(logger, "_experiment", None) is not None:
            logger._experiment.finish(exit_code=1 if failed else 0)  # type: ignore[attr-defined]
            logger._experiment = None  # type: ignore[attr-defined]


@rank_zero_only
def _info(message: str) -> None:
    print(message, flush=True)
