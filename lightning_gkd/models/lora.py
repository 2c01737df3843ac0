"""LoRA students: wrap a loaded causal LM in ``peft`` LoRA adapters so that only the adapters train.

The ``lora`` key of a model spec (``lightning_gkd.models.loading.load_causal_lm``; Hydra: ``model.student.lora.*``) is a
mapping such as ``{"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}``; every other key is
passed to ``peft.LoraConfig`` as is (``bias``, ``use_rslora``, ``use_dora``, ``modules_to_save``,
``layers_to_transform``, ``init_lora_weights``, ...). ``r`` null or 0 (the Hydra default) means no LoRA.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_gkd.models.vision import language_model_only

#: Short names accepted in the spec -> the ``peft.LoraConfig`` argument they set.
_ALIASES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}
DEFAULT_TARGET_MODULES = "all-linear"  # every linear layer except the output head


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is a dev dependency, so the tests always have it
        raise ImportError(
            "A LoRA student (a 'lora' entry in the model spec, e.g. model.student.lora.r=8) needs "
            "the peft package: pip install peft (or pip install 'lightning-gkd[lora]')."
        ) from error
    return peft


def lora_enabled(spec: Any) -> bool:
    """True when ``spec`` (the ``lora`` entry of a model spec) asks for adapters: a ``peft`` config, or a mapping
    with a positive ``r``. None, ``{}`` and ``{"r": null}`` (the Hydra default) mean a plain, fully trained model."""
    if spec is None:
        return False
    if isinstance(spec, Mapping):
        return bool(spec.get("r"))
    return True  # a peft config object


def lora_config(spec: Any) -> Any:
    """``peft.LoraConfig(task_type="CAUSAL_LM", ...)`` from the spec mapping (a ``peft`` config passes through).

    ``r`` (rank, required), ``alpha`` (scaling numerator, default ``2 * r``), ``dropout`` (default 0.0),
    ``target_modules`` (default ``"all-linear"``: every linear layer but the output head; or a list of module
    names such as ``["q_proj", "v_proj"]``), plus any other ``LoraConfig`` argument.
    """
    peft = _import_peft()
    if isinstance(spec, peft.PeftConfig):
        return spec
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"lora must be a mapping like {{'r': 8, 'alpha': 16}} or a peft.LoraConfig, got {type(spec).__name__}."
        )
    kwargs: dict[str, Any] = {}
    for short, name in _ALIASES.items():
        if short in spec and name in spec and spec[short] is not None and spec[name] is not None:
            raise ValueError(f"lora: both {short!r} and {name!r} are set; keep one.")
    for key, value in spec.items():
        argument = _ALIASES.get(str(key), str(key))
        if value is not None or argument not in kwargs:
            kwargs[argument] = value
    rank = kwargs.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora.r must be a positive integer (the adapter rank), got {rank!r}.")
    if kwargs.get("lora_alpha") is None:
        kwargs["lora_alpha"] = 2 * rank
    if kwargs.get("lora_dropout") is None:
        kwargs["lora_dropout"] = 0.0
    if kwargs.get("target_modules") is None:
        kwargs["target_modules"] = DEFAULT_TARGET_MODULES
    elif not isinstance(kwargs["target_modules"], str):
        kwargs["target_modules"] = list(kwargs["target_modules"])
    kwargs.setdefault("task_type", "CAUSAL_LM")
    try:
        return peft.LoraConfig(**kwargs)
    except TypeError as error:
        raise ValueError(
            f"lora: {error}. Allowed keys: r, alpha, dropout, target_modules and the arguments of peft.LoraConfig."
        ) from error


def apply_lora(model: nn.Module, spec: Any, *, role: str = "model") -> nn.Module:
    """Wrap ``model`` in LoRA adapters (``peft.get_peft_model``): the base weights are frozen, only the adapter
    weights (and any ``modules_to_save``) have ``requires_grad``. Returns the ``peft.PeftModel``. A vision-language
    model's vision tower and projector get no adapters (they stay frozen; ``models.vision``) unless the spec names
    ``exclude_modules`` itself."""
    config = lora_config(spec)
    peft = _import_peft()
    if config.exclude_modules is None:
        config.exclude_modules = language_model_only(model)
    if isinstance(model, peft.PeftModel):
        raise ValueError(f"{role}: the model already has PEFT adapters; drop the 'lora' entry from its spec.")
    try:
        with warnings.catch_warnings():  # peft 0.21 calls transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as error:
        raise ValueError(
            f"{role}: cannot add LoRA adapters ({error}). Check lora.target_modules "
            f"({config.target_modules!r}) against the model's module names."
        ) from error
