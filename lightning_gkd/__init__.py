"""lightning_gkd: knowledge distillation for causal language models on PyTorch Lightning and Hydra."""

from lightning_gkd.data.datamodule import ChatDataModule
from lightning_gkd.losses import generalized_jsd_loss
from lightning_gkd.modules.gkd import GKDModule
from lightning_gkd.modules.sft import SFTModule

__all__ = ["ChatDataModule", "GKDModule", "SFTModule", "generalized_jsd_loss"]
__version__ = "0.1.0"
