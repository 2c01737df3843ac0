"""Hugging Face export of a trained module: ``save_pretrained`` + tokenizer + model card, written atomically; LoRA
adapters alone plus an optional merged copy; the full weights of an FSDP2-sharded model as gathered at fit end."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_gkd.evaluation.model_card import write_model_card
from lightning_gkd.ops.hf.forward import is_peft_model, is_sharded
from lightning_gkd.training.checkpoint_io import write_folder_atomically


def export_module(
    module: Any,
    path: str | Path,
    card_info: Mapping[str, Any] | None = None,
    *,
    merged_path: str | Path | None = None,
    full_state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``module.model`` and ``module.tokenizer`` (``module.processor`` instead for a vision-language model) to
    ``path`` (loadable with ``AutoModelForCausalLM.from_pretrained``, or ``AutoModelForImageTextToText`` and
    ``AutoProcessor``) with a ``README.md`` model card; see ``CausalLMModule.export``.

    ``full_state_dict``: for a sharded model, its full weights (gathered when ``trainer.fit`` ended)."""
    model: nn.Module = module.model
    peft = is_peft_model(model)
    info = dict(card_info or {})
    if peft:
        info.setdefault(
            "format",
            "LoRA adapter (peft): load with peft.AutoPeftModelForCausalLM.from_pretrained"
            "(<this folder>) or PeftModel.from_pretrained(<base model>, <this folder>)",
        )
    if is_sharded(model) and (peft or not full_state_dict):
        raise RuntimeError(
            "export() of a sharded model (trainer=fsdp) writes the full weights gathered "
            "when trainer.fit ended, on global rank 0 only (and not for LoRA models)."
        )
    state = full_state_dict if is_sharded(model) else None
    target = _write_model_folder(path, module, model, info, state_dict=state)
    if merged_path is not None and peft:
        merged = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]  # PEFT's; a copy keeps the adapters
        merged.requires_grad_(False)
        info["format"] = "full model: the LoRA adapters merged into the base weights"
        _write_model_folder(merged_path, module, merged, info)
        del merged
    return target


def _write_model_folder(
    path: str | Path,
    module: Any,
    model: nn.Module,
    card_info: Mapping[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    def write(staging: Path) -> None:
        extra = {} if state_dict is None else {"state_dict": state_dict}
        model.save_pretrained(staging, **extra)  # type: ignore[operator]  # an HF or PEFT model's
        # a vision-language model's processor holds its tokenizer, image processor and chat template
        (module.tokenizer if module.processor is None else module.processor).save_pretrained(staging)
        write_model_card(staging / "README.md", module, card_info)

    return write_folder_atomically(path, write)
