"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for Hugging Face causal LMs, used by
``CausalLMModule.configure_model`` under Lightning's ``ModelParallelStrategy`` (``trainer=fsdp``).

Each decoder layer is one FSDP unit; the rest (token embeddings, final norm, LM head) is the root unit, so tied
input/output embeddings share one parameter inside one unit. The student and every frozen model (teacher, DPO
reference) are sharded as separate FSDP trees: ``fully_shard`` never sees the whole LightningModule.

What to know when decoding with a sharded model (``generation.sample_tokens`` calls ``model(...)`` per token):

- Every forward all-gathers each layer's parameters (and frees them after the layer when
  ``reshard_after_forward=True``), so each new token costs one all-gather per layer on every rank: every rank must
  run the same number of forwards, or the ranks that run more wait forever on the others.
- ``reshard_after_forward=False`` (layers) keeps the gathered parameters until the backward: less communication
  in training and decoding, the memory of an unsharded model (for a frozen model until :func:`reshard`).
- A root unit (embeddings, final norm, LM head) keeps its parameters gathered from its forward until the backward
  (FSDP2's default for a root), so the LM head weight can be used after the forward, as plain tensors: the
  memory-lean loss multiplies final hidden states by ``get_output_embeddings().weight`` itself, for the student
  (its gradient reaches FSDP's reduce-scatter like any other) and for the teacher. A frozen model has no backward
  to free its root, so :func:`reshard` frees it (``CausalLMModule.on_before_backward`` does, before the student's
  backward, the memory peak); decoding also reuses the gathered root instead of gathering it for every token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from lightning_gkd.ops.hf.forward import is_sharded

__all__ = [
    "decoder_layers",
    "full_state_dict",
    "is_sharded",
    "mixed_precision_policy",
    "reshard",
    "shard_causal_lm",
    "shard_for_training",
]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: ``model.get_decoder().layers`` when there is one, else every submodule whose
    class is named in ``model._no_split_modules`` (the classes transformers keeps whole when splitting a model)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [module for module in model.modules() if type(module).__name__ in names]
    if not found:
        raise ValueError(
            f"Cannot find the decoder layers of {type(model).__name__} to shard: it has neither "
            "get_decoder().layers nor submodules named in _no_split_modules."
        )
    return found


def shard_causal_lm(
    model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True, mp_policy: Any = None
) -> nn.Module:
    """``fully_shard`` each decoder layer of ``model`` over the 1-D ``mesh``, then ``model`` itself (the root unit:
    embeddings, final norm, LM head). Idempotent: a model that is already sharded is returned as is.

    ``reshard_after_forward`` applies to the layers; the root keeps FSDP2's default (gathered from its forward to
    the backward; for a model without backward, until :func:`reshard`).
    ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` or None (parameters used in their own dtype).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        return model
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit of ``model`` (a no-op for units already sharded)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def mixed_precision_policy(precision: str | None) -> Any:
    """The FSDP2 policy for a Lightning precision flag: ``bf16-mixed`` -> bf16 compute with fp32 parameters and
    fp32 gradient reduction; anything else (``32-true``, ``bf16-true``: the precision plugin casts the parameters
    themselves) -> None."""
    if str(precision) != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict of ``model`` on CPU. For a sharded model this is a collective (every rank must
    call it) and only global rank 0 gets the tensors (others get an empty dict); for a plain model, ``None`` (use
    ``model.state_dict()`` / ``save_pretrained`` as usual)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # a model's state dict holds tensors only


def shard_for_training(
    model: nn.Module, frozen: Mapping[str, nn.Module], mesh: Any, precision: str | None, *, owner: str
) -> bool:
    """Shard the trained ``model`` and each frozen model as separate FSDP2 trees over the data-parallel dimension
    of ``mesh`` (one unit per decoder layer); ``precision`` ``bf16-mixed`` becomes the mixed-precision policy.
    Returns False when ``model`` is already sharded (nothing done). ``owner`` names the module in errors."""
    if is_sharded(model):
        return False
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"{owner} shards with FSDP only (no tensor parallelism): set the "
            "ModelParallelStrategy's data_parallel_size to the number of processes and "
            "tensor_parallel_size=1 (trainer=fsdp does)."
        )
    mesh = mesh["data_parallel"] if "data_parallel" in names else mesh
    policy = mixed_precision_policy(precision)
    shard_causal_lm(model, mesh, mp_policy=policy)
    for frozen_model in frozen.values():
        shard_causal_lm(frozen_model, mesh, mp_policy=policy)
    return True
