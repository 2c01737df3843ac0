"""lightning_gkd: knowledge distillation and preference tuning for causal language models on PyTorch Lightning and
Hydra.

The public names are the imports of the ``TYPE_CHECKING`` block below, the one list of them: type checkers read it
as written, and at run time each name is imported from its module on first use (PEP 562), so
``import lightning_gkd.ops.divergence.jsd`` (the pure losses) does not import Lightning, datasets or the training stack.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `import X as X`: an explicit re-export, for type checkers and linters
    from lightning_gkd.asynchronous.settings import AsyncSettings as AsyncSettings
    from lightning_gkd.data.chat import ChatDataModule as ChatDataModule
    from lightning_gkd.data.preference import PreferenceDataModule as PreferenceDataModule
    from lightning_gkd.evaluation.settings import ValidationSettings as ValidationSettings
    from lightning_gkd.losses.cross_tokenizer_plan import CrossTokenizerSettings as CrossTokenizerSettings
    from lightning_gkd.losses.settings import DivergenceSettings as DivergenceSettings
    from lightning_gkd.losses.settings import PolicyGradientSettings as PolicyGradientSettings
    from lightning_gkd.methods.dpo import DPOModule as DPOModule
    from lightning_gkd.methods.gkd import GKDModule as GKDModule
    from lightning_gkd.methods.opd import OPDModule as OPDModule
    from lightning_gkd.methods.sft import SFTModule as SFTModule
    from lightning_gkd.ops.divergence.jsd import generalized_jsd_loss as generalized_jsd_loss
    from lightning_gkd.ops.divergence.preference import preference_loss as preference_loss
    from lightning_gkd.rollouts.settings import RolloutSettings as RolloutSettings
    from lightning_gkd.samplers.settings import SamplingSettings as SamplingSettings
    from lightning_gkd.training.settings import TrainingSettings as TrainingSettings

__version__ = "0.1.0"


def _public_names() -> dict[str, str]:
    """public name -> its module, read from the ``TYPE_CHECKING`` imports of this file."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {
        alias.name: str(node.module) for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }


_PUBLIC = _public_names()
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gkd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
