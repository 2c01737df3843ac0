"""A hidden-state cache's head (``head.safetensors``): the teacher's output projection and bias, with its scale and
soft-cap in the file's metadata, so ``softcap(scale · (h Wᵀ + b))`` of the cached states are the teacher's logits."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_gkd.ops.hf.heads import LogitHead
from lightning_gkd.teachers.offline.atomic import write_atomically
from lightning_gkd.teachers.offline.format import HEAD_NAME
from lightning_gkd.teachers.offline.manifest import rebuild_hint

#: the one safetensors metadata key of ``head.safetensors``: its ``head_description`` as JSON (one key: stable bytes)
_HEAD_METADATA = "lightning_gkd.head"


def head_description(head: LogitHead) -> dict[str, Any]:
    """What a manifest records of a head besides its tensors (``scale``, ``softcap``, shape and dtype)."""
    return {
        "scale": float(head.scale),
        "softcap": None if head.softcap is None else float(head.softcap),
        "hidden_size": int(head.weight.shape[1]),
        "vocab_size": int(head.weight.shape[0]),
        "dtype": str(head.weight.dtype).removeprefix("torch."),
    }


def write_head(folder: str | Path, head: LogitHead) -> Path:
    """Write ``head`` to ``<folder>/head.safetensors`` atomically: ``weight`` (and ``bias``) in their dtype, its
    ``head_description`` in the file's metadata (read back by ``read_head_description``)."""
    from safetensors.torch import save_file

    tensors = {"weight": head.weight.detach().cpu().contiguous()}
    if head.bias is not None:
        tensors["bias"] = head.bias.detach().cpu().contiguous()
    metadata = {_HEAD_METADATA: json.dumps(head_description(head), sort_keys=True)}
    return write_atomically(Path(folder) / HEAD_NAME, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def read_head_description(folder: str | Path) -> dict[str, Any]:
    """The ``head_description`` stored in ``<folder>/head.safetensors`` (and the file's size, ``bytes``)."""
    from safetensors import safe_open

    path = Path(folder) / HEAD_NAME
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if _HEAD_METADATA not in metadata:
        raise ValueError(f"{path} is not a teacher cache's head (no {_HEAD_METADATA!r} metadata).")
    return {**json.loads(metadata[_HEAD_METADATA]), "bytes": path.stat().st_size}


def read_head(folder: str | Path, manifest: Mapping[str, Any]) -> LogitHead:
    """The head of the hidden-state cache in ``folder`` (``head.safetensors``, checked against ``manifest['head']``)."""
    from safetensors.torch import load_file

    path = Path(folder) / HEAD_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"The hidden-state teacher cache at {folder} has no {HEAD_NAME} (the teacher's head): rebuild it with "
            f"{rebuild_hint(manifest)}."
        )
    tensors = load_file(str(path))
    description = manifest["head"]
    head = LogitHead(tensors["weight"], tensors.get("bias"), float(description["scale"]), description["softcap"])
    found = {key: value for key, value in head_description(head).items() if key in description}
    expected = {key: description[key] for key in found}
    if found != expected:
        raise ValueError(
            f"{path} holds a head {found}, but the cache's manifest describes {expected}: the folder mixes two "
            f"builds. Rebuild it with {rebuild_hint(manifest)}."
        )
    return head
