"""The PyTorch paged attention (CPU backend and kernel oracle) against dense attention per sequence, in PyTorch
ops and through the compiled CPU kernel that serves its few-row sequences."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from paged_backend.kernels import (
    AttentionMetadata,
    LayerAttention,
    PagedCaches,
    cpu_paged_attention,
    paged_attention,
    torch_attention,
    write_kv_cache,
)
from helpers.tolerances import tolerance


def dense_reference(q, k, v, scale, window=None, softcap=None):
    """q [n, H, D] are the last n positions of k, v [L, KVH, D]."""
    n, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0), (4, 30.0)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch-ops"])
def test_mixed_batch_matches_dense(window, softcap, heads, kv_heads, consecutive, kernel):
    torch.manual_seed(0)
    block_size, num_blocks, dim = 4, 32, 16
    # (context already cached, new tokens): decode, chunked prefill after context, fresh prefill
    shapes = [(9, 1), (6, 5), (0, 7), (13, 1)]
    key_cache = torch.randn(kv_heads, num_blocks * block_size, dim)  # garbage everywhere not written
    value_cache = torch.randn_like(key_cache)
    # Shuffled, non-contiguous blocks (contexts gathered), or each sequence's blocks in order (read as views).
    free = list(range(num_blocks))[::-1] if consecutive else torch.randperm(num_blocks).tolist()
    full_k, full_v, tables, slots, queries = [], [], [], [], []
    for ctx, new in shapes:
        length = ctx + new
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        seq_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
        write_kv_cache(k[:ctx], v[:ctx], key_cache, value_cache, seq_slots[:ctx])
        full_k.append(k), full_v.append(v), tables.append(blocks), slots.append(seq_slots[ctx:])
        queries.append(torch.randn(new, heads, dim))
    new_k = torch.cat([k[ctx:] for k, (ctx, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[ctx:] for v, (ctx, _) in zip(full_v, shapes)])
    slot_mapping = torch.cat(slots)
    slot_mapping[1] = -1  # a skipped slot is not written...
    write_kv_cache(new_k, new_v, key_cache, value_cache, slot_mapping)
    write_kv_cache(new_k[1:2], new_v[1:2], key_cache, value_cache, torch.cat(slots)[1:2])  # ...until written
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    lens = [c + n for c, n in shapes]
    metadata = AttentionMetadata(slot_mapping, block_tables, torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), block_size, starts, lens,
                                 max(n for _, n in shapes), max(lens))
    with contextlib.nullcontext() if kernel else cpu_paged_attention.switched_off():
        out = paged_attention(torch.cat(queries), PagedCaches(key_cache, value_cache), metadata,
                              LayerAttention(0.25, window, softcap), new_key=new_k, new_value=new_v)
    assert ("cpu_kernel_sequences" in metadata.derived) == (kernel and cpu_paged_attention.library() is not None)
    read_as_views = [isinstance(torch_attention.sequence_slots(metadata, i), slice) for i in range(len(shapes))]
    assert read_as_views == [all(b == a + 1 for a, b in itertools.pairwise(t)) for t in tables]
    assert all(read_as_views) == consecutive
    for i, (q, k, v) in enumerate(zip(queries, full_k, full_v)):
        ref = dense_reference(q, k, v, 0.25, window, softcap)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, **tolerance(torch.float32, "kernel"))


def test_write_skips_negative_slots():
    cache_k, cache_v = torch.zeros(1, 8, 2), torch.zeros(1, 8, 2)
    write_kv_cache(torch.ones(3, 1, 2), torch.ones(3, 1, 2), cache_k, cache_v, torch.tensor([2, -1, 5]))
    assert cache_k[0, :, 0].tolist() == [0, 0, 1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_rows_attend_in_fp32(dtype: torch.dtype) -> None:
    """One query row of a bf16/fp16 model is attended in fp32 and rounded back (faster on CPU than the
    low-precision kernel path); several rows keep the model's dtype."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((4, 1, 16), (2, 40, 16), (2, 40, 16)))
    out = torch_attention.attend_one(q, k, v, LayerAttention(0.25))
    expected = F.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None], scale=0.25,
                                              enable_gqa=True)[0].to(dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    rows = torch.randn(4, 3, 16, generator=g).to(dtype)
    several = torch_attention.attend_one(rows, k, v, LayerAttention(0.25))
    mask = torch_attention.causal_mask(3, 40, LayerAttention(0.25), q.device)
    assert torch.equal(several, F.scaled_dot_product_attention(rows[None], k[None], v[None], attn_mask=mask, scale=0.25,
                                                               enable_gqa=True)[0])
