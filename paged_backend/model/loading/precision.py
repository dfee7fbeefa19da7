"""The weight dtype the engine picks when the caller does not name one (`dtype=None` or `"auto"`).

CUDA: bf16 (fp16 on GPUs without bf16). CPU: bf16 only where the CPU computes it natively
(`avx512_bf16` or `amx_bf16`), where halving the bytes a decode step reads pays; elsewhere fp32:
without those instructions bf16 matmuls are emulated, and the default model decoded slower in bf16
than in fp32 (README, "Precision").
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")
# "1" or "0": take that as the answer instead of reading the CPU flags (a VM that hides them, or a process
# tree that must pick the same dtype on every machine, as the test suite's Ray and tensor-parallel workers).
NATIVE_BF16_ENV = "PAGED_BACKEND_CPU_BF16"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes bf16 natively: `PAGED_BACKEND_CPU_BF16` when it is "0" or "1", else whether the
    CPU flags name a bf16 instruction set (Linux's /proc/cpuinfo; False where it is absent)."""
    override = os.environ.get(NATIVE_BF16_ENV)
    if override in ("0", "1"):
        return override == "1"
    try:
        text = CPUINFO.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def preferred_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """(the dtype to load weights in on `device`, why), for `dtype=None` or `"auto"`."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA device with bf16"
        return torch.float16, "CUDA device without bf16"
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16, f"the CPU computes bf16 natively ({' or '.join(NATIVE_BF16_FLAGS)})"
    return torch.float32, f"no native bf16 on this {device.type} (no {' or '.join(NATIVE_BF16_FLAGS)}): bf16 is emulated"
