"""The README.md model card written into every export: where the model came from and how it was trained."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PretrainedConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def describe_source(source: Any) -> str | None:
    """A short description of what a model was loaded from: the hub id or folder, ``config: <model_type>``, or
    the ``name_or_path`` recorded in an ``nn.Module``'s config; None when nothing is known."""
    if isinstance(source, nn.Module):
        config = getattr(source, "config", None)
        name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
        return str(name) if name else None
    if isinstance(source, PretrainedConfig):
        return f"config: {source.model_type}"
    if isinstance(source, Mapping):
        if source.get("name_or_path"):
            return str(source["name_or_path"])
        config = source.get("config")
        model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
        return f"config: {model_type}" if model_type else None
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return None


def is_hub_id(name: str | None) -> bool:
    """True for ``org/name`` that is not an existing local path (only those belong in the card's ``base_model``)."""
    return bool(name) and bool(_HUB_ID.match(str(name))) and not Path(str(name)).exists()


def describe_data(source: Any) -> str | None:
    """A short description of a data source: a path or hub id as given, ``<N> rows`` otherwise."""
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, Mapping) and "_target_" in source:  # a Hydra call, as a config gives the data
        args = ", ".join(f"{key!s}={value}" for key, value in source.items() if key != "_target_")
        return f"{source['_target_']}({args})"
    if isinstance(source, Mapping) and not hasattr(source, "column_names"):
        return ", ".join(f"{name}: {describe_data(value)}" for name, value in source.items())
    try:
        return f"{len(source)} rows ({type(source).__name__})"
    except TypeError:
        return type(source).__name__


def card_info_from_trainer(module: Any) -> dict[str, Any]:
    """Steps, final metrics and data of the trainer attached to ``module`` (empty when there is none)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return {}
    info: dict[str, Any] = {
        "global_step": int(trainer.global_step),
        "metrics": {
            key: float(value)
            for key, value in trainer.callback_metrics.items()
            if getattr(value, "numel", lambda: 1)() == 1
        },
    }
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        data = {
            split: describe_data(getattr(datamodule, f"{split}_source", None)) for split in ("train", "val", "test")
        }
        info["data"] = {split: text for split, text in data.items() if text}
    return info


def _dotted(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings (a method's settings groups) flattened to dotted keys, as Hydra names them
    (``divergence.beta``); an empty mapping stays a value."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def model_card(module: Any, card_info: Mapping[str, Any] | None = None) -> str:
    """The model card text (YAML front matter + markdown) for ``module``'s export."""
    info = {**card_info_from_trainer(module), **dict(card_info or {})}
    sources: dict[str, str | None] = dict(getattr(module, "model_sources", {}) or {})
    role = getattr(module, "model_role", "model")
    method = type(module).__name__
    hparams = dict(getattr(module, "hparams", {}) or {})
    base = sources.get(role)
    tag = method.removesuffix("Module").lower()
    front = ["---", "library_name: transformers", "tags:", "- lightning-gkd", f"- {tag}"]
    if is_hub_id(base):
        front.append(f"base_model: {base}")
    front.append("---")
    lines = [
        *front,
        "",
        f"# {Path(str(base)).name if base else 'model'} trained with lightning_gkd ({method})",
        "",
        "## Models",
        "",
    ]
    lines += [
        f"- {name}: `{source}`" if source else f"- {name}: (an in-memory model; source unknown)"
        for name, source in sources.items()
    ]
    lines += ["", f"## Method: {method}", ""]
    lines += [f"- {key}: `{value!r}`" for key, value in sorted(_dotted(hparams).items())] or [
        "- (no hyperparameters recorded)"
    ]
    data = info.pop("data", None)
    if data:
        lines += ["", "## Data", ""]
        lines += [f"- {split}: {text}" for split, text in data.items()] if isinstance(data, Mapping) else [f"- {data}"]
    lines += ["", "## Training", ""]
    if "global_step" in info:
        lines.append(f"- steps: {info.pop('global_step')}")
    metrics = info.pop("metrics", None) or {}
    for key, value in info.items():
        lines.append(f"- {key}: {value}")
    if metrics:
        lines += ["", "## Final metrics", "", "| metric | value |", "|---|---|"]
        lines += [
            f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
            for key, value in sorted(metrics.items())
        ]
    lines += [
        "",
        "Load it with `AutoModelForCausalLM.from_pretrained(<this folder or repo>)`; the tokenizer is saved beside it.",
        "",
    ]
    return "\n".join(lines)


def write_model_card(path: str | Path, module: Any, card_info: Mapping[str, Any] | None = None) -> Path:
    """Write ``model_card(module, card_info)`` to ``path``."""
    path = Path(path)
    path.write_text(model_card(module, card_info), encoding="utf-8")
    return path
