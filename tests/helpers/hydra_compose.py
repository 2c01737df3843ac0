"""Compose the real Hydra config in-process, as the entry point would, writing under a temp dir."""

from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict


def compose_train(tmp_path: Path, overrides: list[str], *, config: str = "train", run_dir: str = "run") -> DictConfig:
    """``config`` (conf/train.yaml, or e.g. conf/evaluate.yaml) composed with ``overrides``, writing under
    ``tmp_path / run_dir``."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose(config, return_hydra_config=True, overrides=[f"paths.cache_dir={tmp_path / 'cache'}", *overrides])
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / run_dir)
    return cfg
