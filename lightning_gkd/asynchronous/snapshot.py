"""``WeightSnapshot``: one version of the student's weights, taken on the trainer after an optimizer step and handed
to a rollout engine as one batched transfer (one flat buffer per dtype; in shared memory on the CPU, so a child
process maps it instead of copying it through a pipe; on a GPU it stays on the device and travels by CUDA IPC)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightning_gkd.models.weights import hf_weights

__all__ = ["WeightSnapshot"]


@dataclass(frozen=True)
class WeightSnapshot:
    """The weights of ``version`` (the optimizer steps they have seen), HF-named (``models.weights.hf_weights``:
    FSDP2 shards gathered, LoRA merged).

    ``buffers``: one flat 1-D tensor per dtype (by ``str(dtype)``); ``layout``: ``(name, dtype key, shape, offset)``
    of each tensor in its buffer; ``seconds``: how long taking it blocked the trainer."""

    version: int
    buffers: dict[str, torch.Tensor]
    layout: list[tuple[str, str, tuple[int, ...], int]]
    seconds: float

    @classmethod
    def take(cls, model: nn.Module, version: int, *, shared: bool) -> WeightSnapshot:
        """Copy ``model``'s weights now into fresh flat buffers on its device (``shared`` and on the CPU: in shared
        memory). Under FSDP2 every rank calls it at the same time (the shards are gathered)."""
        started = time.perf_counter()
        tensors = [(name, tensor.detach()) for name, tensor in hf_weights(model)]
        sizes: dict[str, int] = {}
        layout: list[tuple[str, str, tuple[int, ...], int]] = []
        for name, tensor in tensors:
            key = str(tensor.dtype)
            layout.append((name, key, tuple(tensor.shape), sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + tensor.numel()
        buffers: dict[str, torch.Tensor] = {}
        for key, size in sizes.items():
            first = next(tensor for _, tensor in tensors if str(tensor.dtype) == key)
            buffer = torch.empty(size, dtype=first.dtype, device=first.device)
            if shared and buffer.device.type == "cpu":
                buffer.share_memory_()
            buffers[key] = buffer
        with torch.no_grad():
            for (_, tensor), (_, key, _, offset) in zip(tensors, layout, strict=True):
                buffers[key][offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        return cls(version, buffers, layout, time.perf_counter() - started)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)``: views into the buffers, in the model's order."""
        for name, key, shape, offset in self.layout:
            numel = 1
            for size in shape:
                numel *= size
            yield name, self.buffers[key][offset : offset + numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())
