"""conf/train.yaml composed in this process, as ``lightning-gkd`` composes it, for code that builds from the configs
instead of the command line: a method module (``build_method``: the one way the benchmarks and asset scripts
construct GKD, OPD, SFT or DPO modules, so their settings are the command line's keys, ``method.lmbda=1``) and a
whole run (``train``: what ``lightning-gkd <overrides>`` does, returning its result; ``train_seeds``: one per
seed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict


def compose_train(overrides: Sequence[str], *, output_dir: str | Path | None = None) -> DictConfig:
    """conf/train.yaml with ``overrides`` (the command line's), its Hydra node set for ``${hydra:...}``;
    ``output_dir``: the run's folder (``paths.output_dir``; default Hydra's run folder under outputs/runs)."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_gkd.conf", version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = str(output_dir)
    return cfg


#: objects that ``build_method`` puts into a settings group rather than passing as arguments
GROUPED_OBJECTS = {"optimizer": "training", "scheduler": "training", "sampler": "sampling"}


def build_method(overrides: Sequence[str], **objects: Any) -> Any:
    """The method module ``cfg.method`` describes (``method=gkd|opd|sft|dpo`` and its ``method.<key>=...`` among the
    ``overrides``), built with ``objects`` in place of the config's values: the models (``student``/``teacher``, or
    ``model``/``reference``) as modules or folders, the ``tokenizer``, an ``optimizer`` or ``scheduler`` factory (into
    the ``training`` group), a ``sampler`` factory (into ``sampling``). The config's other values are conf/method's
    defaults."""
    cfg = compose_train(overrides)
    grouped = {name: objects.pop(name) for name in list(objects) if name in GROUPED_OBJECTS}
    # the config's values first (a partial), then the objects as arguments: they replace values whole (a dict or a
    # class is never merged into the config)
    method = instantiate(cfg.method, _partial_=True, _convert_="all")
    for name, value in grouped.items():
        group = GROUPED_OBJECTS[name]
        method.keywords[group] = {**method.keywords.get(group, {}), name: value}
    return method(**objects)


def train_seeds(overrides: Sequence[str], seeds: Sequence[int], *, output_dir: str | Path) -> list[dict[str, Any]]:
    """``train`` once per seed (``seed=<seed>`` last), into ``output_dir``/seed<seed>; their results in order."""
    return [train([*overrides, f"seed={seed}"], output_dir=Path(output_dir) / f"seed{seed}") for seed in seeds]


def held_out_after(result: dict[str, Any], metric: str = "accuracy") -> float:
    """A run's held-out ``metric`` after training (``callbacks.held_out_eval``)."""
    try:
        return float(result["held_out"]["after"][metric])
    except KeyError:
        raise ValueError(
            f"The run reported no held-out {metric!r} after training: keep callbacks.held_out_eval and a test_data."
        ) from None


def train(overrides: Sequence[str], *, output_dir: str | Path) -> dict[str, Any]:
    """One ``lightning-gkd <overrides>`` run in this process, writing to ``output_dir``; its result (held-out scores,
    metrics, ``study`` with ``callbacks.study_record``; ``lightning_gkd.cli.train.run``)."""
    from lightning_gkd.cli.train import run

    return run(compose_train(["print_config=false", *overrides], output_dir=output_dir))
