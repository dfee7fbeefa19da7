"""Triton cache write (reshape-and-cache): the step's new K/V into their paged-cache slots.

One program per new token copies all its KV heads at once: `[KVH, D]` is a few KiB, so a single
tile per token keeps the launch small and every access is a contiguous row of `D` elements.
An int8 cache gets each (token, head) row quantized with its own scale, written beside it, the
same way as `kv_quant.quantize_int8` computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import check_scales


@triton.jit
def store_row(x, cache_ptr, scale_ptr, dst, scale_dst, mask, heads_ok, QUANTIZE: tl.constexpr):
    """Store `x [HEADS, D]` at `dst`; quantized to int8 with one scale per head row when QUANTIZE."""
    if QUANTIZE:
        x = x.to(tl.float32)
        scale = tl.max(tl.abs(x), 1) / 127.0
        safe = tl.where(scale == 0.0, 1.0, scale)
        q = tl.floor(x / safe[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(cache_ptr + dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + scale_dst, scale, mask=heads_ok)
    else:
        tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, key_scale_ptr, value_scale_ptr,
    num_kv_heads, head_dim,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_c_h, stride_c_slot, stride_c_d, stride_s_h,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, QUANTIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding or a token that must not be cached
        return
    heads = tl.arange(0, HEADS_PAD).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD).to(tl.int64)
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    # int64 throughout: slot * stride overflows int32 once a layer's cache passes 2**31 elements.
    dst = heads[:, None] * stride_c_h + slot * stride_c_slot + dims[None, :] * stride_c_d
    scale_dst = heads * stride_s_h + slot
    heads_ok = heads < num_kv_heads
    key = tl.load(key_ptr + token * stride_k_t + heads[:, None] * stride_k_h + dims[None, :] * stride_k_d,
                  mask=mask, other=0.0)
    store_row(key, key_cache_ptr, key_scale_ptr, dst, scale_dst, mask, heads_ok, QUANTIZE)
    value = tl.load(value_ptr + token * stride_v_t + heads[:, None] * stride_v_h + dims[None, :] * stride_v_d,
                    mask=mask, other=0.0)
    store_row(value, value_cache_ptr, value_scale_ptr, dst, scale_dst, mask, heads_ok, QUANTIZE)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Write `key`/`value` `[T, KVH, D]` into caches `[KVH, num_slots, D]`; negative slots are skipped.
    An int8 cache needs `key_scales/value_scales [KVH, num_slots]` fp32, contiguous in slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share one layout")
    quantize = key_cache.dtype == torch.int8
    if quantize:
        check_scales(key_cache, key_scales, value_scales)
    else:
        key_scales = value_scales = key_cache  # unused placeholders
    write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales,
        num_kv_heads, head_dim,
        *key.stride(), *value.stride(), *key_cache.stride(), key_scales.stride(0) if quantize else 0,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
    )

