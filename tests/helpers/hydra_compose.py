"""Compose the real Hydra config in-process, as the entry point would, writing under a temp dir.

Composing costs ~0.2-0.4 s (most of a short test), so each (config, overrides) is composed once per session with a
placeholder for the test's temp dir, and every call gets its own deep copy with the placeholder replaced by its
temp dir: the same config, values and recorded overrides (hydra.overrides.task) as composing it afresh, and a test
that changes its copy changes no other test's."""

import copy
import functools
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, open_dict, read_write

#: stands for the test's temp dir in the composed configs kept for the session
PLACEHOLDER = "/compose-train-tmp-path-placeholder"


def compose_train(tmp_path: Path, overrides: list[str], *, config: str = "train", run_dir: str = "run") -> DictConfig:
    """``config`` (conf/train.yaml, or e.g. conf/evaluate.yaml) composed with ``overrides``, writing under
    ``tmp_path / run_dir``."""
    GlobalHydra.instance().clear()
    tmp = str(tmp_path)
    cfg = copy.deepcopy(_composed(config, tuple(override.replace(tmp, PLACEHOLDER) for override in overrides)))
    with read_write(cfg), open_dict(cfg):
        _replace(cfg, PLACEHOLDER, tmp)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / run_dir)
    return cfg


@functools.cache
def _composed(config: str, overrides: tuple[str, ...]) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        return compose(config, return_hydra_config=True, overrides=[f"paths.cache_dir={PLACEHOLDER}/cache", *overrides])


def _replace(node: DictConfig | ListConfig, old: str, new: str) -> None:
    """Every string value under ``node`` (interpolations as written, unresolved) with ``old`` replaced by ``new``."""
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not (
            child._is_none() or child._is_missing() or child._is_interpolation()
        ):
            _replace(child, old, new)
        elif isinstance(raw := child._value(), str) and old in raw:
            node[key] = raw.replace(old, new)


#: a short run of the default job: 3 steps, one validation batch, every step logged
FAST = [
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "method.sampling.max_new_tokens=6",
    "print_config=false",
]
