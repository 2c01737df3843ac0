"""Final hidden states of a causal LM at chosen positions, without projecting every position to logits.

The model is still called through its own (outermost) ``forward``, so wrappers keep working: PEFT adapters,
FSDP2 units (whose hooks gather parameters) and DDP. A forward hook on the decoder captures its output, and
``logits_to_keep`` (an empty index) tells the language-model head to project no position at all.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, cast

import torch
from torch import nn

from lightning_gkd.generation import _unwrap, position_ids_from_mask

__all__ = ["LeanForwardUnsupported", "final_hidden_states", "output_weight"]


class LeanForwardUnsupported(RuntimeError):
    """The model lacks what the hidden-state path needs (a decoder, a bias-free output projection, or
    ``logits_to_keep``); use full logits instead."""


class _CausalLMCore(Protocol):
    """What the lean path calls on the unwrapped model (``_causal_lm`` checks each at run time)."""

    def get_decoder(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...


def _causal_lm(model: nn.Module) -> _CausalLMCore:
    core = _unwrap(model)
    for attribute in ("get_decoder", "get_output_embeddings"):
        if not callable(getattr(core, attribute, None)):
            raise LeanForwardUnsupported(f"{type(core).__name__} has no {attribute}()")
    if "logits_to_keep" not in inspect.signature(core.forward).parameters:
        raise LeanForwardUnsupported(f"{type(core).__name__}.forward does not take logits_to_keep")
    return cast(_CausalLMCore, core)


def output_weight(model: nn.Module) -> torch.Tensor:
    """The ``(V, H)`` weight of the model's output projection (``lm_head``), which must have no bias."""
    head = _causal_lm(model).get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise LeanForwardUnsupported(f"output projection {type(head).__name__} is not a bias-free nn.Linear")
    return head.weight


def final_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The decoder's final (normed) hidden states at ``positions``.

    Args:
        model: a Hugging Face causal LM, possibly wrapped (PEFT, FSDP2 units).
        input_ids: ``(B, L)`` left-padded tokens.
        attention_mask: ``(B, L)``, 1 on real tokens; position ids are counted from each row's first real token.
        positions: ``(B, L)`` bool, the positions to return.

    Returns:
        ``(N, H)`` hidden states of the ``N = positions.sum()`` selected positions, in row-major order (the order
        of ``tensor[positions]``).
    """
    decoder = _causal_lm(model).get_decoder()
    captured: dict[str, torch.Tensor] = {}

    def capture(module: nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        captured["hidden"] = hidden if hidden is not None else output[0]

    handle = decoder.register_forward_hook(capture)
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
        )
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise LeanForwardUnsupported(f"{type(decoder).__name__} did not run in the model's forward")
    return captured["hidden"][positions]
