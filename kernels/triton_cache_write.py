"""Triton cache write (reshape-and-cache): the step's new K/V into their paged-cache slots.

One program per new token copies all its KV heads at once: `[KVH, D]` is a few KiB, so a single
tile per token keeps the launch small and every access is a contiguous row of `D` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_kv_heads, head_dim,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_c_h, stride_c_slot, stride_c_d,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
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
    key = tl.load(key_ptr + token * stride_k_t + heads[:, None] * stride_k_h + dims[None, :] * stride_k_d,
                  mask=mask)
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * stride_v_t + heads[:, None] * stride_v_h + dims[None, :] * stride_v_d,
                    mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` `[T, KVH, D]` into caches `[KVH, num_slots, D]`; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share one layout")
    write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, head_dim,
        *key.stride(), *value.stride(), *key_cache.stride(),
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=triton.next_power_of_2(head_dim),
    )
