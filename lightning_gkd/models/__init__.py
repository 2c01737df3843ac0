"""Loading the trained and frozen models (hub id, folder, config, spec), LoRA, FSDP2 sharding, and the tiny models
the project builds and ships.

The names that ``lightning_gkd.models`` held when it was one module (``load_causal_lm``, ``freeze``, ...) resolve
here on first use, from ``lightning_gkd.models.loading``, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_LOADING_NAMES = {
    "ModelSource",
    "check_same_vocab",
    "disable_dropout",
    "freeze",
    "load_causal_lm",
    "quantization_config_from_dict",
    "resolve_dtype",
    "vocab_size",
}


def __getattr__(name: str) -> Any:
    if name not in _LOADING_NAMES:
        raise AttributeError(f"module 'lightning_gkd.models' has no attribute {name!r}")
    warnings.warn(
        f"lightning_gkd.models.{name} moved to lightning_gkd.models.loading.{name}.", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module("lightning_gkd.models.loading"), name)
