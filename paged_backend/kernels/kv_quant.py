"""int8 K/V: one fp32 scale per token and KV head, written beside the cache by the cache write.

A row of `head_dim` values is stored as `round(x / scale)` with `scale = max|x| / 127`, so the
largest value of every (token, head) row is exact and the others are off by at most half a step
(`scale / 2`). A per-token scale needs no calibration and follows outliers token by token (a
per-tensor scale would be set by the largest key anywhere); it costs 4 bytes per 64-byte row.

Rounding is `floor(x / scale + 0.5)`, the form the Triton cache write computes too, so both
backends store the same integers.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
SCALE_DTYPE = torch.float32


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., D]` -> (int8 values `[..., D]`, fp32 scales `[...]`); an all-zero row gets scale 0."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = torch.floor(x / safe[..., None] + 0.5).clamp_(-INT8_MAX, INT8_MAX)
    return values.to(torch.int8), scale


def dequantize_int8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 `values [..., D]` times their `scale [...]`, as `dtype`."""
    return (values.float() * scale[..., None]).to(dtype)


def check_scales(key_cache: torch.Tensor, key_scales: torch.Tensor | None,
                 value_scales: torch.Tensor | None) -> None:
    """An int8 cache's scales: fp32 `[KVH, num_slots]`, one layout for K and V, contiguous in slots."""
    want = tuple(key_cache.shape[:2])
    for scales in (key_scales, value_scales):
        if scales is None or tuple(scales.shape) != want or scales.dtype != torch.float32 or scales.stride(1) != 1:
            raise ValueError(f"an int8 cache needs fp32 scales of shape {want}, contiguous in slots")
    if key_scales.stride() != value_scales.stride():
        raise ValueError("key_scales and value_scales must share one layout")
