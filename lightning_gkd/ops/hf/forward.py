"""Calling Hugging Face causal LMs (pure torch, no Lightning): unwrapping DDP/PEFT wrappers, the keywords a
``forward`` takes, position ids of left-padded batches, an eval-mode context, the float32 matmul precision, and
EOS/pad ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "EosTokenId",
    "accepts_logits_to_keep",
    "cache_keyword",
    "check_matmul_precision",
    "eval_mode",
    "float32_matmul_precision",
    "is_peft_model",
    "is_sharded",
    "position_ids_from_mask",
    "resolve_eos_token_id",
    "resolve_pad_token_id",
    "unwrap",
]

EosTokenId = int | Sequence[int] | None


def unwrap(model: nn.Module) -> nn.Module:
    """The model whose ``forward`` signature names the HF arguments.

    Wrappers such as DDP (``.module``) or PEFT (``.get_base_model()``) take ``**kwargs`` and pass them through, so
    their own signature does not say which keywords the wrapped model expects.
    """
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        params = inspect.signature(model.forward).parameters
        if "cache" in params or "past_key_values" in params:
            return model
        get_base_model = getattr(model, "get_base_model", None)
        inner = getattr(model, "module", None)
        if callable(get_base_model):
            model = get_base_model()
        elif isinstance(inner, nn.Module):
            model = inner
        else:
            break
    return model


def _forward_parameters(model: nn.Module) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(unwrap(model).forward).parameters


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the (unwrapped) model's ``forward`` takes ``logits_to_keep`` (project only some positions)."""
    return "logits_to_keep" in _forward_parameters(model)


def cache_keyword(model: nn.Module) -> str:
    """The KV-cache keyword of ``model.forward``: ``cache`` (transformers >= 5.24) over the deprecated
    ``past_key_values``, which is also the fallback when neither is named."""
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"


def is_peft_model(model: nn.Module) -> bool:
    """A ``peft.PeftModel``: adapters that ``disable_adapter()`` switches off, ``save_pretrained`` writes alone and
    ``merge_and_unload`` folds in."""
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` (or a submodule) has been through FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for (left-)padded rows.

    Args:
        attention_mask: ``(B, L)`` tensor, 1 on real tokens and 0 on padding.

    Returns:
        ``(B, L)`` long tensor ``cumsum(mask) - 1`` clamped at 0, so the real tokens of each row get positions
        ``0, 1, ...`` and leading padding gets position 0.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


MATMUL_PRECISIONS = ("highest", "high", "medium")


def check_matmul_precision(precision: str | None) -> None:
    """ValueError naming the value unless ``precision`` is None or one of torch's float32 matmul precisions."""
    if precision is not None and precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS} or null, got {precision!r}")


@contextmanager
def float32_matmul_precision(precision: str | None) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(precision)`` inside the block, the previous setting restored afterwards
    (also on an exception); ``None`` leaves it alone. "medium" allows float32 matrix products with bfloat16 inputs
    and float32 accumulation (on CPUs torch then uses oneDNN's kernels, which use bf16 on AMX; tensor cores on
    GPUs); "high" allows TF32; "highest" is exact float32."""
    check_matmul_precision(precision)
    if precision is None:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block (dropout off; HF models keep their KV cache even with gradient
    checkpointing on); every submodule's own ``training`` flag is restored afterwards, also on an exception."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, flag in flags:
            module.training = flag


def resolve_eos_token_id(model: nn.Module, tokenizer: Any = None) -> int | list[int] | None:
    """The EOS id(s) to stop generation on: ``model.generation_config.eos_token_id`` when set (an id or a
    non-empty list), else ``tokenizer.eos_token_id`` when a tokenizer is given, else ``None``."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None and not (isinstance(eos, (list, tuple)) and len(eos) == 0):
        return list(eos) if isinstance(eos, tuple) else eos
    if tokenizer is not None:
        return getattr(tokenizer, "eos_token_id", None)
    return None


def resolve_pad_token_id(tokenizer: Any) -> int:
    """The id generated rows are padded with after their EOS: the tokenizer's pad id, else its EOS id (as the
    DataModules set it when a tokenizer has no pad token)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{type(tokenizer).__name__} has neither a pad nor an EOS token; set tokenizer.pad_token.")
    return int(pad)
