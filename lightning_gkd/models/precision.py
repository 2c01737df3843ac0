"""The dtype frozen models (teacher, reference) run in: bfloat16 where the hardware multiplies bf16 fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_gkd.models.loading import resolve_dtype

#: The dtype a frozen model takes under each 16- or 64-bit trainer precision.
PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}
FROZEN_DTYPE_CHOICES = "'auto', 'float32', 'bfloat16' or 'float16'"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """Whether bfloat16 matrix multiplies beat float32 ones on ``device``: a CUDA GPU with bf16 tensor cores
    (compute capability >= 8.0), or a CPU with AMX or AVX512-BF16 instructions (oneDNN uses them; measured on an
    AVX512-BF16 CPU: 354 vs 155 GFLOP/s at a 512 x 896 x 4864 product)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    if any(callable(probe := getattr(torch.cpu, name, None)) and probe() for name in probes):
        return True
    return bool(_cpu_flags() & {"amx_bf16", "avx512_bf16"})


def check_frozen_dtype(choice: str, *, where: str = "") -> None:
    """ValueError naming the value (after ``where``) unless ``choice`` is 'auto' or a floating dtype name."""
    if choice == "auto":
        return
    try:
        dtype = resolve_dtype(choice)
    except ValueError:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}frozen_dtype must be {FROZEN_DTYPE_CHOICES}, got {choice!r}.")


def frozen_model_dtype(choice: str, trainer_precision: str, device: torch.device | str) -> torch.dtype | None:
    """The dtype for a frozen model whose own dtype was not fixed.

    ``choice`` a dtype name: that dtype. ``"auto"``: the trainer's dtype under a 16- or 64-bit precision; under
    32-bit precision bfloat16 where :func:`bf16_matmul_is_fast` on ``device``, else float32; ``None`` (leave the
    model as loaded) under other precision plugins (e.g. transformer-engine)."""
    if choice != "auto":
        return resolve_dtype(choice)
    if trainer_precision in PRECISION_DTYPES:
        return PRECISION_DTYPES[trainer_precision]
    if trainer_precision == "32-true":
        return torch.bfloat16 if bf16_matmul_is_fast(device) else torch.float32
    return None


def is_quantized(model: Any) -> bool:
    """A model loaded with a quantization config (bitsandbytes, ...): its dtype is not ours to change."""
    return bool(getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None)
