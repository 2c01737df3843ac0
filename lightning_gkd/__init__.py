"""lightning_gkd: knowledge distillation and preference tuning for causal language models on PyTorch Lightning and
Hydra.

The public names below are imported on first use (PEP 562), so ``import lightning_gkd.ops.losses`` (the pure
losses) does not import Lightning, datasets or the training stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_PUBLIC = {
    "ChatDataModule": "lightning_gkd.data.chat",
    "PreferenceDataModule": "lightning_gkd.data.preference",
    "GKDModule": "lightning_gkd.methods.gkd",
    "OPDModule": "lightning_gkd.methods.opd",
    "DPOModule": "lightning_gkd.methods.dpo",
    "SFTModule": "lightning_gkd.methods.sft",
    "generalized_jsd_loss": "lightning_gkd.ops.losses",
    "preference_loss": "lightning_gkd.ops.losses",
}
__all__ = [
    "ChatDataModule",
    "DPOModule",
    "GKDModule",
    "OPDModule",
    "PreferenceDataModule",
    "SFTModule",
    "generalized_jsd_loss",
    "preference_loss",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from lightning_gkd.data.chat import ChatDataModule
    from lightning_gkd.data.preference import PreferenceDataModule
    from lightning_gkd.methods.dpo import DPOModule
    from lightning_gkd.methods.gkd import GKDModule
    from lightning_gkd.methods.opd import OPDModule
    from lightning_gkd.methods.sft import SFTModule
    from lightning_gkd.ops.losses import generalized_jsd_loss, preference_loss


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gkd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
