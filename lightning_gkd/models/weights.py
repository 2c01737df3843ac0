"""A causal LM's full weights under their Hugging Face names, one tensor at a time, for loading into another engine
(vLLM's ``reload_weights``) without materialising a second full copy of the model.

* Plain model: its parameters and buffers as they are (no copy).
* FSDP2-sharded model (``trainer=fsdp``): each ``DTensor`` is gathered on its own (``full_tensor()``, a collective
  every rank runs in the same order), yielded, and freed before the next one, so at most one full parameter exists
  at a time beside the shards.
* LoRA model (peft): each adapted linear layer's merged weight ``W + scaling * B @ A`` is computed when it is
  yielded; the adapter weights themselves are not yielded and the live model is not modified.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lightning_gkd.ops.hf.forward import is_peft_model, is_sharded

__all__ = ["hf_weights", "check_weights_exportable"]

_PEFT_PREFIX = "base_model.model."


def check_weights_exportable(model: nn.Module, *, owner: str) -> None:
    """ValueError (naming ``owner``) when ``hf_weights`` cannot stream ``model``: a sharded LoRA model."""
    if is_sharded(model) and is_peft_model(model):
        raise ValueError(
            f"{owner}: syncing a LoRA student that is FSDP-sharded into a serving engine is not supported. "
            "Train the LoRA student under trainer=ddp (or a single device), or train it fully under trainer=fsdp."
        )


def hf_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter and persistent buffer of ``model``, named as in the model's own
    ``save_pretrained`` (``model.layers.0.self_attn.q_proj.weight``, ...). See the module docstring for sharded
    and LoRA models. Iterate it once, to the end, on every rank at the same time when the model is sharded."""
    check_weights_exportable(model, owner="hf_weights")
    if is_peft_model(model):
        yield from _merged_lora_weights(model)
        return
    for name, tensor in _named_tensors(model):
        yield name, _full(tensor)


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    non_persistent = {
        f"{prefix}.{buffer}" if prefix else buffer
        for prefix, module in model.named_modules()
        for buffer in getattr(module, "_non_persistent_buffers_set", ())
    }
    for name, buffer in model.named_buffers():
        if name not in non_persistent:
            yield name, buffer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor (FSDP2 shard)
    return (full_tensor() if callable(full_tensor) else tensor).detach()


def _merged_lora_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from peft.tuners.lora import LoraLayer

    lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, tensor in _named_tensors(model):
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter factors (merged below) and the frozen copy a modules_to_save entry replaces
        hf_name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        layer_name, _, leaf = name.rpartition(".base_layer.")
        layer = lora_layers.get(layer_name) if leaf == "weight" else None
        if layer is not None and not getattr(layer, "merged", False):
            tensor = tensor.detach()
            for adapter in layer.active_adapters:
                if adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {}):
                    tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)  # type: ignore[attr-defined]  # on Linear/Embedding subclasses
        yield hf_name, tensor.detach()
