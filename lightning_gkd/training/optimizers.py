"""Optimizer factories for configs and the methods' default: torch's AdamW, fused wherever torch has the kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

#: Device types with a fused AdamW kernel when torch cannot tell us (older or unusual builds).
_FALLBACK_FUSED_DEVICES = ("cpu", "cuda")


def fused_kernel_devices() -> list[str]:
    """Device types for which this torch build ships fused optimizer kernels (CPU and CUDA among them)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper
        return list(_FALLBACK_FUSED_DEVICES)


def _tensors(params: Iterable[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for entry in params:
        tensors.extend(entry["params"] if isinstance(entry, dict) else [entry])
    return tensors


def fused_supported(params: Iterable[Any]) -> bool:
    """Whether torch's fused AdamW runs on ``params`` (tensors or param-group dicts): every one floating point and
    on a device type with the fused kernel. FSDP2's DTensors count by their local device."""
    devices = set(fused_kernel_devices())
    tensors = _tensors(params)
    return bool(tensors) and all(t.is_floating_point() and t.device.type in devices for t in tensors)


def adamw(params: Iterable[Any], *, fused: bool | None = None, foreach: bool | None = None, **kwargs: Any):
    """``torch.optim.AdamW(params, **kwargs)``, fused by default: ``fused=None`` (default) takes the fused kernel
    whenever :func:`fused_supported` says it runs (one kernel over all parameters instead of a Python loop over
    them: on CPU ~9x faster at 0.5B parameters, same result to float rounding) and torch's own choice otherwise;
    ``fused=False`` (or a ``foreach`` choice) keeps torch's default path."""
    params = list(params)
    if fused is None and foreach is None:
        fused = fused_supported(params) or None
    return torch.optim.AdamW(params, fused=fused, foreach=foreach, **kwargs)


def amp_clipping(trainer: Any) -> bool:
    """Whether ``trainer`` clips gradients under a mixed-precision plugin: Lightning then refuses optimizers that
    unscale gradients inside their step, as fused ones may."""
    return "mixed" in str(getattr(trainer, "precision", "")) and bool(getattr(trainer, "gradient_clip_val", None))


def build_optimizer(factory: Callable[..., Any], params: list[Any], *, allow_fused: bool) -> Any:
    """``factory(params)``; when fused kernels are not allowed (see :func:`amp_clipping`) and the factory is
    :func:`adamw` leaving ``fused`` to its default, the unfused AdamW instead. A factory asking for ``fused=True``
    keeps it (Lightning's own error then says why)."""
    if not allow_fused and getattr(factory, "func", factory) is adamw:
        if getattr(factory, "keywords", {}).get("fused") is None:
            return factory(params, fused=False)
    return factory(params)
