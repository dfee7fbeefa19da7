"""Triton paged attention: one kernel for prefill, chunked prefill, prefix hits and decode.

The grid is (query block, KV head[, KV segment]). A query block holds `BLOCK_Q` consecutive new
tokens of one sequence times the `GROUP` query heads that share the KV head, packed into
`BLOCK_M = BLOCK_Q * GROUP_PAD` rows, so each K/V tile is loaded once per KV head and serves the
whole group. Sequences are found from the program id by a binary search over `query_start_loc`,
which lets the host size the grid from `T` and `num_seqs` alone (no per-step index tensors).

Keys are read through the block table one position at a time (slot = block * block_size +
offset), so the tile size is independent of the cache block size and any block size works.
Softmax is online in fp32 and stays finite on rows that see no key; all offsets are int64 and
every load is masked, because the unwritten tail of a sequence's last block may hold garbage.

Split-KV decode: when a pure decode batch has too few (sequence, KV head) programs to fill the
GPU, each program's keys are cut into segments run in parallel; a second kernel merges their
partial softmax states.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_quant import check_scales
from .layer_attention import LayerAttention
from .layer_cache import PagedCaches
from .metadata import AttentionMetadata


@triton.jit
def find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block `q_block`: sequence i owns the blocks from
    `query_start_loc[i] // BLOCK_Q + i` on, which over-counts by at most one block per sequence."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def tanh(x):
    # libdevice tanh fails in the interpreter; this form saturates to +-1 instead of overflowing.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


# num_seqs changes every step: specialising on it (== 1, divisible by 16) would recompile mid-run.
@triton.jit(do_not_specialize=["num_seqs"])
def paged_attention_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, key_scale_ptr, value_scale_ptr, sinks_ptr,
    scale, softcap, sliding_window, chunk_size, num_seqs, block_size, num_heads, head_dim,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_h, stride_c_slot, stride_bt, stride_s_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, KV_INT8: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
):
    attend_query_block(
        out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr, q_ptr, key_scale_ptr, value_scale_ptr, sinks_ptr,
        scale, softcap, sliding_window, chunk_size, num_seqs, block_size, num_heads, head_dim,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_c_h, stride_c_slot, stride_bt, stride_s_h,
        GROUP, GROUP_PAD, BLOCK_M, TILE_N, HEAD_PAD, NUM_SEGMENTS, USE_SOFTCAP, USE_WINDOW, False, KV_INT8,
        USE_SINKS, USE_CHUNK,
    )


# The ALiBi variant is a kernel of its own so the plain kernel's signature (and compiled binaries)
# stay as they are; both inline the same program.
@triton.jit(do_not_specialize=["num_seqs"])
def paged_attention_alibi_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, alibi_ptr, key_scale_ptr, value_scale_ptr, sinks_ptr,
    scale, softcap, sliding_window, chunk_size, num_seqs, block_size, num_heads, head_dim,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_h, stride_c_slot, stride_bt, stride_s_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, KV_INT8: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
):
    attend_query_block(
        out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr, alibi_ptr, key_scale_ptr, value_scale_ptr, sinks_ptr,
        scale, softcap, sliding_window, chunk_size, num_seqs, block_size, num_heads, head_dim,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_c_h, stride_c_slot, stride_bt, stride_s_h,
        GROUP, GROUP_PAD, BLOCK_M, TILE_N, HEAD_PAD, NUM_SEGMENTS, USE_SOFTCAP, USE_WINDOW, True, KV_INT8,
        USE_SINKS, USE_CHUNK,
    )


@triton.jit
def attend_query_block(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, alibi_ptr, key_scale_ptr, value_scale_ptr, sinks_ptr,
    scale, softcap, sliding_window, chunk_size, num_seqs, block_size, num_heads, head_dim,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_h, stride_c_slot, stride_bt, stride_s_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, KV_INT8: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
):
    """One program: one query block of one sequence against one KV head (one segment of its keys)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:  # the spare block of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = local_block * BLOCK_Q + rows // GROUP_PAD
    member = rows % GROUP_PAD
    head = kv_head * GROUP + member
    row_ok = (q_local < q_len) & (member < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < head_dim
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_offs = (q_start + q_local).to(tl.int64)[:, None] * stride_q_t + head.to(tl.int64)[:, None] * stride_q_h
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=q_mask, other=0.0)
    q_pos = context_len + q_local  # absolute position of each row's query token
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)

    # Keys this block can see: up to its last query's position, from the start of its window.
    kv_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    first_tile = 0
    first_q_pos = context_len + local_block * BLOCK_Q  # the block's earliest query sees the earliest keys
    if USE_WINDOW:
        first_tile = tl.maximum(first_q_pos - sliding_window + 1, 0) // TILE_N
    if USE_CHUNK:
        first_tile = tl.maximum(first_tile, (first_q_pos - first_q_pos % chunk_size) // TILE_N)
    num_tiles = tl.cdiv(kv_end, TILE_N) - first_tile
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_lo = first_tile + segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        # The sink is one more logit with no value: the softmax state starts from it (max = sink, sum = 1),
        # in the first segment only, so split-KV's merge counts it once.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = tl.where(segment == 0, sink, m_i)
        l_i = tl.where(segment == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    head_base = kv_head.to(tl.int64) * stride_c_h
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_end
        block = tl.load(table_row + k_pos // block_size, mask=k_ok, other=0)
        slot = block.to(tl.int64) * block_size + k_pos % block_size
        kv_offs = head_base + slot[:, None] * stride_c_slot + dims[None, :]
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if KV_INT8:  # one scale per (slot, head) row
            scale_offs = kv_head.to(tl.int64) * stride_s_h + slot
            k = k.to(tl.float32) * tl.load(key_scale_ptr + scale_offs, mask=k_ok, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(value_scale_ptr + scale_offs, mask=k_ok, other=0.0)[:, None]
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:
            s = softcap * tanh(s / softcap)
        if USE_ALIBI:
            # Relative to the query (<= 0 on visible keys): softmax is shift-invariant per row, so this
            # equals the models' absolute `slope * key_pos` and keeps the logits small.
            s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        if USE_CHUNK:
            allowed = allowed & (k_pos[None, :] >= (q_pos - q_pos % chunk_size)[:, None])
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps max -inf; shifting by 0 keeps exp() at 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + q_local).to(tl.int64)[:, None] * stride_o_t + head.to(tl.int64)[:, None] * stride_o_h
        tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partial state per (token, head, segment), merged by merge_segments_kernel.
        state = ((q_start + q_local).to(tl.int64) * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + state, m_i, mask=row_ok)
        tl.store(part_sum_ptr + state, l_i, mask=row_ok)
        tl.store(part_acc_ptr + state[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def merge_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, head_dim, stride_o_t, stride_o_h,
    NUM_SEGMENTS: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_PAD)
    state = (token * num_heads + head) * NUM_SEGMENTS + segs
    m = tl.load(part_max_ptr + state)
    sums = tl.load(part_sum_ptr + state)
    acc = tl.load(part_acc_ptr + state[:, None] * HEAD_PAD + dims[None, :])
    m_all = tl.max(m, 0)
    weight = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    total = tl.sum(sums * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_offs = token * stride_o_t + head.to(tl.int64) * stride_o_h + dims
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    block_m: int  # query rows per program (query tokens x padded GQA group)
    tile_n: int  # keys per inner iteration
    num_segments: int = 1  # >1: split-KV; a power of two
    num_warps: int = 4
    num_stages: int = 2


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(
    query: torch.Tensor, num_kv_heads: int, metadata: AttentionMetadata
) -> LaunchConfig:
    """Tile sizes for this step: small row blocks when few query tokens per sequence (decode),
    larger for prefill; split-KV when a long-context decode batch has too few programs."""
    group_pad = triton.next_power_of_2(query.shape[1] // num_kv_heads)
    head_pad = triton.next_power_of_2(query.shape[2])
    prefill = metadata.max_query_len * group_pad > 32
    # Sizes checked with `ptxas -v` for sm_90: none of these spills registers.
    block_m = max(group_pad, (32 if head_pad > 128 else 64) if prefill else 16)
    tile_n = 32 if head_pad > 128 or not prefill else 64
    num_warps = 8 if block_m * head_pad >= 64 * 128 else 4
    num_segments = 1
    if metadata.is_pure_decode and metadata.num_kv_segments is not None:
        num_segments = metadata.num_kv_segments
    elif metadata.is_pure_decode and query.is_cuda:
        num_segments = decode_segments(metadata.num_seqs, num_kv_heads, metadata.max_seq_len, query.device, tile_n)
    return LaunchConfig(block_m, tile_n, num_segments, num_warps, num_stages=2 if head_pad > 128 else 3)


def decode_segments(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                    tile_n: int = 32) -> int:
    """Split-KV segments (a power of two, at most 16) for a decode batch: enough (sequence, KV head,
    segment) programs to fill the GPU's multiprocessors, while each segment keeps several key tiles."""
    programs = num_seqs * num_kv_heads
    sms = multiprocessor_count(device.index or 0)
    max_segments = max_seq_len // (4 * tile_n)  # keep several tiles per segment
    segments = 1
    while segments < 16 and programs * segments < sms and segments * 2 <= max_segments:
        segments *= 2
    return segments


def paged_attention(
    query: torch.Tensor,
    cache: PagedCaches,
    metadata: AttentionMetadata,
    layer: LayerAttention,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Attention of packed `query [T, H, D]` over the paged `cache` (K and V `[KVH, num_slots, D]`) with what
    `layer` asks for; returns `[T, H, D]`.

    The caches may be of a lower precision than the query (read and converted tile by tile), or int8
    with fp32 scales `[KVH, num_slots]`, one per (head, slot).
    ALiBi slopes `[H]` fp32 add `slope * (key position - query position)` to each head's logits.
    Sinks `[H]` join each head's softmax as a logit with no value (gpt-oss); a chunk hides the keys
    before the start of the query's chunk (Llama 4's chunked layers).
    `config` overrides the tile choice (tests use it to reach every kernel variant on small inputs).
    """
    key_cache, value_cache, key_scales, value_scales = cache
    scale, window, softcap, chunk, alibi_slopes, sinks = (layer.scale, layer.window, layer.softcap, layer.chunk,
                                                          layer.alibi_slopes, layer.sinks)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(2) != 1:
        raise ValueError("key_cache and value_cache must share one layout, contiguous in head_dim")
    if query.stride(2) != 1:
        query = query.contiguous()
    config = config or choose_config(query, num_kv_heads, metadata)
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = triton.next_power_of_2(head_dim)
    if config.block_m % group_pad:
        raise ValueError(f"block_m={config.block_m} must be a multiple of the padded GQA group {group_pad}")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if alibi_slopes is not None and (alibi_slopes.shape != (num_heads,) or alibi_slopes.dtype != torch.float32):
        raise ValueError(f"alibi_slopes must be fp32 of shape ({num_heads},), got {alibi_slopes.dtype} "
                         f"{tuple(alibi_slopes.shape)}")
    segments = config.num_segments
    parts = allocate_partials(num_tokens, num_heads, segments, head_pad, query.device)
    block_q = config.block_m // group_pad
    grid = (num_tokens // block_q + metadata.num_seqs, num_kv_heads, segments)
    kernel, alibi = paged_attention_kernel, ()
    if alibi_slopes is not None:
        kernel, alibi = paged_attention_alibi_kernel, (alibi_slopes.to(query.device).contiguous(),)
    kv_int8 = key_cache.dtype == torch.int8
    if kv_int8:
        check_scales(key_cache, key_scales, value_scales)
    else:
        key_scales = value_scales = key_cache  # unused placeholders
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
    sinks_arg = key_cache if sinks is None else sinks.to(query.device).contiguous()  # a placeholder when unused
    kernel[grid](
        out, query, key_cache, value_cache,
        metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, *parts, *alibi, key_scales, value_scales,
        sinks_arg, scale, softcap or 0.0, window or 0, chunk or 1, metadata.num_seqs,
        metadata.block_size, num_heads, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), metadata.block_tables.stride(0),
        key_scales.stride(0) if kv_int8 else 0,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=config.block_m, TILE_N=config.tile_n,
        HEAD_PAD=head_pad, NUM_SEGMENTS=segments,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None, KV_INT8=kv_int8,
        USE_SINKS=sinks is not None, USE_CHUNK=chunk is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if segments > 1:
        merge_segments_kernel[(num_tokens, num_heads)](
            out, *parts, num_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SEGMENTS=segments, HEAD_PAD=head_pad,
        )
    return out


def allocate_partials(
    num_tokens: int, num_heads: int, segments: int, head_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (acc, max, sum) per (token, head, segment); a 1-element placeholder when not split."""
    if segments == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy, dummy
    states = num_tokens * num_heads * segments
    return (
        torch.empty(states * head_pad, dtype=torch.float32, device=device),
        torch.empty(states, dtype=torch.float32, device=device),
        torch.empty(states, dtype=torch.float32, device=device),
    )
