"""lightning_gkd: knowledge distillation for causal language models on PyTorch Lightning and Hydra."""

from lightning_gkd.data.datamodule import ChatDataModule
from lightning_gkd.data.preference_datamodule import PreferenceDataModule
from lightning_gkd.losses import generalized_jsd_loss, preference_loss
from lightning_gkd.modules.dpo import DPOModule
from lightning_gkd.modules.gkd import GKDModule
from lightning_gkd.modules.sft import SFTModule

__all__ = [
    "ChatDataModule",
    "DPOModule",
    "GKDModule",
    "PreferenceDataModule",
    "SFTModule",
    "generalized_jsd_loss",
    "preference_loss",
]
__version__ = "0.1.0"
