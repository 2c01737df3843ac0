"""Hydra configuration tree (shipped as the package lightning_gkd.conf).

Importing it (as Hydra does to find the configs) registers the ``${asset:NAME}`` resolver: the path of an asset
shipped inside the package (``lightning_gkd/assets/NAME``), used by the default toy models; and
``${default_to:VALUE,DEFAULT}``: VALUE unless it is null (the trainer configs' ``precision``: the run's top-level
``precision`` when a preset or the command line set it, else the trainer choice's own).
"""

from omegaconf import OmegaConf


def _asset(name: str) -> str:
    from lightning_gkd.toy.tiny import asset_path

    return asset_path(name)


OmegaConf.register_new_resolver("asset", _asset, replace=True)


def _default_to(value: object, default: object) -> object:
    return default if value is None else value


OmegaConf.register_new_resolver("default_to", _default_to, replace=True)
