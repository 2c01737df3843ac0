"""The frozen models' dtype rule: which hardware counts as fast in bf16, and what each choice and trainer precision
gives."""

import pytest
import torch

from lightning_gkd.models import precision
from lightning_gkd.models.precision import check_frozen_dtype, frozen_model_dtype


@pytest.mark.parametrize(
    "choice, trainer_precision, fast, expected",
    [
        ("auto", "32-true", True, torch.bfloat16),
        ("auto", "32-true", False, torch.float32),
        ("auto", "bf16-mixed", False, torch.bfloat16),
        ("auto", "16-mixed", True, torch.float16),
        ("auto", "64-true", True, torch.float64),
        ("auto", "transformer-engine", True, None),
        ("float32", "32-true", True, torch.float32),
        ("bfloat16", "32-true", False, torch.bfloat16),
        ("torch.float16", "bf16-mixed", True, torch.float16),
    ],
)
def test_frozen_model_dtype(monkeypatch, choice, trainer_precision, fast, expected):
    monkeypatch.setattr(precision, "bf16_matmul_is_fast", lambda device: fast)
    assert frozen_model_dtype(choice, trainer_precision, "cpu") == expected


@pytest.mark.parametrize("bad", ["fp8", "int8", "float33", "long"])
def test_a_wrong_frozen_dtype_names_the_choices(bad):
    with pytest.raises(ValueError, match=f"frozen_dtype must be 'auto', 'float32'.*got '{bad}'"):
        check_frozen_dtype(bad)


def test_cpu_detection_reads_torch_probes_then_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx2", "fma"})
    assert not precision.bf16_matmul_is_fast("cpu")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision.bf16_matmul_is_fast("cpu")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: set())
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.bf16_matmul_is_fast(torch.device("cpu"))
    assert not precision.bf16_matmul_is_fast("meta")


def test_cuda_needs_bf16_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not precision.bf16_matmul_is_fast("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert precision.bf16_matmul_is_fast("cuda:0")


def test_detection_matches_this_machine():
    flags = precision._cpu_flags()
    if flags:  # Linux: the answer follows /proc/cpuinfo (torch's own probes agree with it)
        assert precision.bf16_matmul_is_fast("cpu") == bool(flags & {"amx_bf16", "avx512_bf16"})
