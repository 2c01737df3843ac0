"""Module paths from before the package was split into rooms (``lightning_gkd.losses``,
``lightning_gkd.modules.gkd``, ...): importing one still works, gives the module at its new home (the very same
module object, so classes and ``isinstance`` agree) and warns once with a ``DeprecationWarning`` naming the new path.
Hydra ``_target_`` strings a user wrote with an old path resolve the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

#: old module path -> its home now
MOVED: dict[str, str] = {
    "lightning_gkd.losses": "lightning_gkd.ops.losses",
    "lightning_gkd.chunked_jsd": "lightning_gkd.ops.chunked_jsd",
    "lightning_gkd.generation": "lightning_gkd.ops.sampling",
    "lightning_gkd.hidden_states": "lightning_gkd.ops.hf",
    "lightning_gkd.lora": "lightning_gkd.models.lora",
    "lightning_gkd.sharding": "lightning_gkd.models.sharding",
    "lightning_gkd.assets": "lightning_gkd.models.tiny",
    "lightning_gkd.modules": "lightning_gkd.methods",
    "lightning_gkd.modules.base": "lightning_gkd.methods.base",
    "lightning_gkd.modules.gkd": "lightning_gkd.methods.gkd",
    "lightning_gkd.modules.dpo": "lightning_gkd.methods.dpo",
    "lightning_gkd.modules.sft": "lightning_gkd.methods.sft",
    "lightning_gkd.checkpoint_io": "lightning_gkd.training.checkpoint_io",
    "lightning_gkd.resume": "lightning_gkd.training.resume",
    "lightning_gkd.export_callback": "lightning_gkd.callbacks.hf_export",
    "lightning_gkd.sample_table": "lightning_gkd.callbacks.sample_table",
    "lightning_gkd.held_out_eval": "lightning_gkd.callbacks.held_out_eval",
    "lightning_gkd.signals": "lightning_gkd.callbacks.signal_checkpoint",
    "lightning_gkd.model_card": "lightning_gkd.evaluation.model_card",
    "lightning_gkd.hub": "lightning_gkd.cli.hub",
    "lightning_gkd.data.chat_collator": "lightning_gkd.data.chat",
    "lightning_gkd.data.datamodule": "lightning_gkd.data.chat",
    "lightning_gkd.data.grouping": "lightning_gkd.data.loader",
    "lightning_gkd.data.row_dataset": "lightning_gkd.data.rows",
    "lightning_gkd.data.preference_collator": "lightning_gkd.data.preference",
    "lightning_gkd.data.preference_datamodule": "lightning_gkd.data.preference",
    "lightning_gkd.data.toy_preference": "lightning_gkd.data.toy.preference",
}
# Kept as real files instead (they are entry points, or a package now stands at that name): lightning_gkd.train
# (``python -m lightning_gkd.train``), lightning_gkd.models (now the package; its old names are re-exported there),
# lightning_gkd.callbacks, lightning_gkd.evaluation and lightning_gkd.data.toy (packages that re-export the old
# module's names).


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import it from there (the old path goes away in a later release).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:  # already executed at its new home
        pass


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED.get(fullname)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(new_name))


def install() -> None:
    """Put the finder first, before the path finder, which would otherwise load an old path found inside an
    aliased package (``lightning_gkd.modules.gkd`` inside ``methods/``) a second time as a new module."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
