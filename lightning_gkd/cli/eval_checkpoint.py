"""A lightning-gkd run's checkpoint for ``lightning-gkd-eval``: read weights-only, checked against the student it
goes into (from the student's config.json, before any weights load, then against the built module), loaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_gkd.training.checkpoint_io import CheckpointError, SafeCheckpointIO


def read_checkpoint(path: str) -> dict[str, Any]:
    """A Lightning checkpoint of a lightning-gkd run, read weights-only (``SafeCheckpointIO``'s errors)."""
    checkpoint = SafeCheckpointIO().load_checkpoint(path)
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping) or not any(key.startswith("model.") for key in state):
        raise CheckpointError(
            f"{path!r} is not a checkpoint of a lightning-gkd run: it has no state_dict with the trained model's "
            "weights (model.*). Pass a .ckpt from <run>/checkpoints/, or an exported model folder."
        )
    return checkpoint


def _run_overrides(path: str) -> str:
    """The overrides of the run that wrote checkpoint ``path`` (``<run>/.hydra/overrides.yaml``), as a hint."""
    for folder in list(Path(path).parents)[:2]:
        overrides = folder / ".hydra" / "overrides.yaml"
        if overrides.is_file():
            values = OmegaConf.load(overrides)
            listed = " ".join(str(v) for v in values) if isinstance(values, Sequence) else ""
            return f" That run ({folder}) was started with: {listed or '(no overrides)'}."
    return ""


def checkpoint_mismatch(expected: Mapping[str, torch.Size], state: Mapping[str, Any]) -> str | None:
    """What differs between a model's parameter shapes and a checkpoint's (``model.*`` keys), or None."""
    saved = {key: tuple(value.shape) for key, value in state.items() if key.startswith("model.")}
    wanted = {key: tuple(shape) for key, shape in expected.items() if key.startswith("model.")}
    missing, unexpected = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    shared = sorted(set(saved) & set(wanted))
    shapes = [f"{k}: checkpoint {saved[k]}, model {wanted[k]}" for k in shared if saved[k] != wanted[k]]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} weights have other shapes ({'; '.join(shapes[:2])})")
    if missing:
        parts.append(f"{len(missing)} of the model's weights are not in it ({', '.join(missing[:2])})")
    if unexpected:
        parts.append(f"{len(unexpected)} of its weights are not in the model ({', '.join(unexpected[:2])})")
    return "; ".join(parts) or None


def raise_mismatch(path: str, what: str, problem: str) -> NoReturn:
    raise ValueError(
        f"Checkpoint {path!r} does not fit {what}: {problem}. It was written by a run with "
        "another model.student; evaluate it with that run's model settings (model=..., model.student...)."
        f"{_run_overrides(path)}"
    )


def expected_student_shapes(spec: Mapping[str, Any]) -> dict[str, torch.Size] | None:
    """Parameter shapes (Lightning keys ``model.*``) of the student ``spec`` would build, from its folder's
    config.json on the meta device (no weights read); None when that cannot be known without loading it (a hub id,
    LoRA, a config spec)."""
    lora = spec.get("lora")
    name = spec.get("name_or_path")
    if (isinstance(lora, Mapping) and lora.get("r")) or not name or not (Path(str(name)) / "config.json").is_file():
        return None
    config = AutoConfig.from_pretrained(str(name), trust_remote_code=bool(spec.get("trust_remote_code")))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=bool(spec.get("trust_remote_code")))
    return {f"model.{key}": value.shape for key, value in model.state_dict().items()}


def check_fits_student(checkpoint: Mapping[str, Any], spec: Mapping[str, Any], path: str) -> None:
    """Before the student loads: the checkpoint's weights must have the shapes ``spec``'s config.json gives
    (ValueError naming the first differences and the overrides of the run that wrote it); unchecked when the shapes
    cannot be told without loading (``load_weights`` checks again against the built module)."""
    expected = expected_student_shapes(spec)
    problem = checkpoint_mismatch(expected, checkpoint["state_dict"]) if expected else None
    if problem:
        raise_mismatch(path, f"model.student ({spec.get('name_or_path')})", problem)


def load_weights(module: Any, checkpoint: dict[str, Any], path: str) -> None:
    """Load a checkpoint's weights into ``module`` (frozen models come from the live module, as on resume)."""
    frozen = tuple(f"{name}." for name in getattr(module, "frozen_names", ()))
    expected = {k: v.shape for k, v in module.state_dict().items() if not k.startswith(frozen)}
    problem = checkpoint_mismatch(expected, checkpoint["state_dict"])
    if problem:
        raise_mismatch(path, f"this config's {type(module).__name__}", problem)
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"], strict=True)
