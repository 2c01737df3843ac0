"""Hydra configuration tree (shipped as the package lightning_gkd.conf).

Importing it (as Hydra does to find the configs) registers the ``${asset:NAME}`` resolver: the path of an asset
shipped inside the package (``lightning_gkd/assets/NAME``), used by the default toy models.
"""

from omegaconf import OmegaConf


def _asset(name: str) -> str:
    from lightning_gkd.models.tiny import asset_path

    return asset_path(name)


OmegaConf.register_new_resolver("asset", _asset, replace=True)
