"""PyTorch paged attention and cache write: the CPU backend and the oracle for the Triton kernels. On CPU the
sequences with a few query rows go to the compiled kernel of cpu_paged_attention.py where it is built.

Per-sequence gather + `scaled_dot_product_attention` was measured faster on CPU than padding the batch or
masking a block-diagonal packed batch, in every shape tried, so a sequence with many query rows is
attended alone; sequences with one or a few rows over a context attend in buckets of similar length
(torch_buckets.py), padded only to their bucket's longest.
The gather indices depend only on the step, so they are built once per step and reused by every layer.
A sequence whose blocks are consecutive in the pool (a lone stream's usually are) is read as a view of
the cache instead, which saves the gather's copy (in bf16 the cast to fp32 remains; docs/design.md has the
measurements).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu_paged_attention
from .kv_quant import dequantize_int8, quantize_int8
from .layer_attention import LayerAttention
from .layer_cache import LayerCache, PagedCaches
from .metadata import AttentionMetadata, host_block_tables
from .torch_buckets import ContextReader, attend_bucket, plan_buckets


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new `key`/`value` `[T, KVH, D]` into caches `[KVH, num_slots, D]`; negative slots are skipped.
    An int8 cache stores each (token, head) row quantized, its scale in `key_scales/value_scales
    [KVH, num_slots]`. Returns the K/V as the cache now holds them, in the input dtype (the inputs
    themselves when the cache has their dtype), so attention reading them directly sees what a
    later step will read from the cache."""
    return write_rows(key, value, key_cache, value_cache, slot_mapping, writable_rows(slot_mapping),
                      key_scales, value_scales)


def writable_rows(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """The rows of a step with a slot to write (bool `[T]`), or None when every row has one."""
    keep = slot_mapping >= 0
    return None if bool(keep.all()) else keep


def write_rows(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slot_mapping: torch.Tensor, rows: torch.Tensor | None, key_scales: torch.Tensor | None,
               value_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """write_kv_cache() of `rows` (None: all) of the step, found by writable_rows()."""
    stored_key = write_one(key, key_cache, key_scales, slot_mapping, rows)
    stored_value = write_one(value, value_cache, value_scales, slot_mapping, rows)
    return stored_key, stored_value


def write_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerCache,
    metadata: AttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:
    """write_kv_cache() of this step's `key/value [T, KVH, D]` into one layer's cache (`cache.kv [2 (K, V), KVH,
    num_slots, D]`, an int8 one with its `cache.scales [2, KVH, num_slots]`), then paged_attention() of
    `query [T, H, D]` over the context they joined. Which rows have a slot is found once per step, not per
    layer, and a sequence's K and V are gathered together (one gather and one cast, not two of each)."""
    layer_cache, layer_scales = cache
    caches = cache.key_value()
    if (cpu_paged_attention.serves(query, caches.key_cache)
            and cpu_paged_attention.stores(key, value, caches.key_cache, metadata.slot_mapping)):
        # The kernel's call stores the rows itself, first: no index_copy per K and V, and one call per layer.
        new_rows, stored = (key, value), (key, value)
    else:
        if "torch_writable_rows" not in metadata.derived:
            metadata.derived["torch_writable_rows"] = writable_rows(metadata.slot_mapping)
        new_rows = None
        stored = write_rows(key, value, caches.key_cache, caches.value_cache, metadata.slot_mapping,
                            metadata.derived["torch_writable_rows"], caches.key_scales, caches.value_scales)

    # K and V as one `[2 * KVH, slots, D]` tensor: one 3-D gather is as fast as either of two (a 4-D one
    # takes torch's slower general path), and one cast follows it.
    heads, dim = layer_cache.shape[1], layer_cache.shape[-1]
    joint = layer_cache.view(2 * heads, -1, dim)
    joint_scales = None if layer_scales is None else layer_scales.view(2 * heads, -1)

    def read(slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        context = read_context(joint, joint_scales, slots, dtype)
        return context[:heads], context[heads:]

    return attend_sequences(query, read, heads, metadata, layer, stored, caches, new_rows)


def write_and_attend_latent(
    query: torch.Tensor,
    latent: torch.Tensor,
    cache: PagedCaches,
    metadata: AttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:
    """Multi-head latent attention's write and attention (dispatch.write_and_attend_latent): write `latent [T, 1, D]`
    into the latent `cache` (its key and value caches one `[1, num_slots, D]`, int8: with scales `[1, num_slots]`),
    then attend `query [T, H, D]` over each sequence's latents, read once per sequence and used as both its key and
    its value."""
    latents, scales = cache.key_cache, cache.key_scales
    if "torch_writable_rows" not in metadata.derived:
        metadata.derived["torch_writable_rows"] = writable_rows(metadata.slot_mapping)
    stored = write_one(latent, latents, scales, metadata.slot_mapping, metadata.derived["torch_writable_rows"])

    def read(slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        context = read_context(latents, scales, slots, dtype)
        return context, context

    return attend_sequences(query, read, 1, metadata, layer, (stored, stored), cache)


def write_one(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, slot_mapping: torch.Tensor,
              rows: torch.Tensor | None) -> torch.Tensor:
    """Store `x [T, KVH, D]` (only `rows`, when given) at `slot_mapping`; return it as stored."""
    slots = slot_mapping if rows is None else slot_mapping[rows]
    if cache.dtype == torch.int8:
        values, scale = quantize_int8(x)
        cache.index_copy_(1, slots, (values if rows is None else values[rows]).transpose(0, 1))
        scales.index_copy_(1, slots, (scale if rows is None else scale[rows]).transpose(0, 1))
        return dequantize_int8(values, scale, x.dtype)
    converted = x.to(cache.dtype)
    cache.index_copy_(1, slots, (converted if rows is None else converted[rows]).transpose(0, 1))
    return x if cache.dtype == x.dtype else converted.to(x.dtype)


def read_context(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor | slice,
                 dtype: torch.dtype) -> torch.Tensor:
    """The K or V `[KVH, L, D]` at `slots` (or both, from a layer's cache viewed as `[2 * KVH, slots, D]`),
    in `dtype` (dequantized from an int8 cache). A slice of slots is a view of the cache, copied only by a
    cast."""
    values = select_slots(cache, slots)
    if scales is not None:
        return dequantize_int8(values, select_slots(scales, slots), dtype)
    return values if values.dtype == dtype else values.to(dtype)


def select_slots(tensor: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    """`tensor [heads, num_slots, ...]` at `slots` along dim 1: a view for a slice, a gather otherwise."""
    return tensor[:, slots] if isinstance(slots, slice) else tensor.index_select(1, slots)


def sequence_slots(metadata: AttentionMetadata, i: int) -> torch.Tensor | slice:
    """The cache slots of positions `0..seq_len-1` of sequence `i`, memoised for the step (only sequences read
    one by one need them): a slice where its blocks are consecutive in the pool (as a lone stream's usually
    are, the pool handing out blocks in order), so its context is read as a view of the cache with no gather;
    else an index tensor."""
    cached = metadata.derived.setdefault("torch_sequence_slots", {})
    slots = cached.get(i)
    if slots is None:
        bs, seq_len = metadata.block_size, metadata.seq_lens_host[i]
        blocks = host_block_tables(metadata)[i, : -(-seq_len // bs)].astype(np.int64)
        start = int(blocks[0]) * bs
        if (np.diff(blocks) == 1).all():
            slots = slice(start, start + seq_len)
        else:
            index = (blocks[:, None] * bs + np.arange(bs, dtype=np.int64)).ravel()[:seq_len]
            slots = torch.from_numpy(index).to(metadata.block_tables.device)
        cached[i] = slots
    return slots


def causal_mask(num_queries: int, seq_len: int, layer: LayerAttention, device: torch.device) -> torch.Tensor:
    """Bool `[n, L]`: key position <= context length + query position (and inside the layer's window, and inside
    the query's chunk: Llama 4's chunked attention)."""
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if layer.window is not None:
        allowed &= k_pos > q_pos - layer.window
    if layer.chunk is not None:
        allowed &= k_pos >= q_pos - q_pos % layer.chunk
    return allowed


def alibi_bias(
    slopes: torch.Tensor, num_queries: int, seq_len: int, allowed: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive `[H, n, L]` mask: `slope * (key position - query position)` where allowed, else -inf.
    Relative to the query, which softmax cannot tell from the models' absolute `slope * key_pos`."""
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=slopes.device)[:, None]
    k_pos = torch.arange(seq_len, device=slopes.device)[None, :]
    bias = slopes.float()[:, None, None] * (k_pos - q_pos).float()
    return bias.masked_fill(~allowed, float("-inf")).to(dtype)


def widened_mask(allowed: torch.Tensor, spans: tuple[tuple[int, int], ...], layer: LayerAttention) -> torch.Tensor:
    """`allowed [n, L]` (the causal rule) with each span's queries seeing every key of the span (an image whose
    tokens attend both ways; spans as offsets from the sequence's end), still inside the layer's window, as
    transformers' bidirectional image mask combines with its sliding window."""
    num_queries, seq_len = allowed.shape
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=allowed.device)[:, None]
    k_pos = torch.arange(seq_len, device=allowed.device)[None, :]
    for first, last in spans:
        start, end = seq_len + first, seq_len + last
        extra = (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
        if layer.window is not None:
            extra &= k_pos > q_pos - layer.window
        allowed = allowed | extra
    return allowed


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerAttention,
    masks: dict | None = None,
    widened: tuple[tuple[int, int], ...] | None = None,
) -> torch.Tensor:
    """Attention of `q [H, n, D]` over `k, v [KVH, L, D]` whose last `n` positions are the queries, with what
    `layer` asks for. `masks` memoises a step's masks by shape (and window, chunk and ALiBi slopes), so every
    layer reuses them. `widened`: spans whose queries see all their keys (widened_mask)."""
    n, seq_len = q.shape[1], k.shape[1]
    masks = {} if masks is None else masks
    window, chunk, slopes, scale = layer.window, layer.chunk, layer.alibi_slopes, layer.scale

    def allowed() -> torch.Tensor:
        return memo(masks, ("causal", n, seq_len, window, chunk), lambda: causal_mask(n, seq_len, layer, q.device))

    if widened:  # none of the shortcuts below holds
        mask = memo(masks, ("widened", n, seq_len, window, chunk, widened),
                    lambda: widened_mask(allowed(), widened, layer))
        if layer.softcap is not None or layer.sinks is not None or slopes is not None:
            return attend_eager(q, k, v, mask, layer)
        return sdpa(q, k, v, mask, False, scale)

    if layer.softcap is not None or layer.sinks is not None:  # SDPA has neither
        return attend_eager(q, k, v, allowed(), layer)
    restricted = layer.hides_keys(seq_len)
    if slopes is not None:
        slopes_key = (q.dtype, tuple(slopes.tolist()))
        mask = memo(masks, ("alibi", n, seq_len, window, chunk, slopes_key), lambda: alibi_bias(
            slopes.to(q.device), n, seq_len, allowed(), q.dtype))
        is_causal = False
    elif n == 1 and not restricted:
        mask, is_causal = None, False
    elif n == seq_len and not restricted:
        mask, is_causal = None, True
    elif few_rows(q, n):
        group = q.shape[0] // k.shape[0]
        bias = memo(masks, ("few_rows", n, seq_len, window, chunk, group),
                    lambda: few_rows_bias(allowed(), group))
        return attend_few_rows(q, k, v, bias, scale)
    else:
        mask, is_causal = allowed(), False
    if n == 1 and q.dtype in UPCAST_DECODE_DTYPES and q.device.type == "cpu":
        # An additive (ALiBi) mask joins the upcast: SDPA takes a float mask only in the query's dtype.
        mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
        return sdpa(q.float(), k.float(), v.float(), mask, is_causal, scale).to(q.dtype)
    return sdpa(q, k, v, mask, is_causal, scale)


# One query row in bf16/fp16 takes a CPU kernel path several times slower than fp32's, casts included; from
# two rows on the low-precision path is as fast or faster. So decode rows attend in fp32, the result rounded
# back, which sped up the throughput workload in bf16 (docs/design.md has the measurements). The price: a bf16
# model's decode attention rounds as fp32 does, not as transformers' bf16 SDPA, so greedy text can part from HF
# generate's in bf16 at a near-tie (fp32 models are unaffected).
UPCAST_DECODE_DTYPES = (torch.bfloat16, torch.float16)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
         scale: float) -> torch.Tensor:
    """`scaled_dot_product_attention` of `q [H, n, D]` over `k, v [KVH, L, D]`, grouped heads as they are."""
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out[0]


# A few fp32 query rows over a longer context (a request verifying proposed tokens, a short chunk) attend
# as two batched matmuls with an additive mask: SDPA's masked CPU path was slower at 2-16 rows, and faster again
# only past 32 rows (docs/design.md has the measurements). bf16/fp16 stay on SDPA, whose kernel keeps the scores
# in fp32.
FEW_ROWS = (2, 16)


def most_matmul_rows(dtype: torch.dtype) -> int:
    """The most query rows of a sequence that attend in fp32 by matmul on CPU: a few in an fp32 model, one
    (a decode row, upcast: UPCAST_DECODE_DTYPES) in the others."""
    return FEW_ROWS[1] if dtype == torch.float32 else 1


def few_rows(q: torch.Tensor, n: int) -> bool:
    return FEW_ROWS[0] <= n <= most_matmul_rows(q.dtype) and q.device.type == "cpu"


def few_rows_bias(allowed: torch.Tensor, group: int) -> torch.Tensor:
    """`allowed [n, L]` as an additive fp32 mask `[1, group * n, L]`, one copy per query head of a group."""
    bias = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(group, 1)[None]


def attend_few_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of `q [H, n, D]` over `k, v [KVH, L, D]`: each KV head's group of query heads stacked
    as `group * n` rows of one matmul (the order `bias` repeats its mask in)."""
    kv_heads, dim = k.shape[0], q.shape[-1]
    scores = torch.baddbmm(bias, q.reshape(kv_heads, -1, dim), k.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), v).view(q.shape)


def memo(cache: dict, key: tuple, build) -> torch.Tensor:
    value = cache.get(key)
    if value is None:
        value = cache[key] = build()
    return value


def attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 layer: LayerAttention) -> torch.Tensor:
    """Eager attention in fp32 under bool `mask [n, L]`, for what SDPA cannot express: tanh logit soft-capping
    (Gemma 2) and attention sinks (gpt-oss: a logit per head `sinks [H]` appended to each row's scores, its weight
    dropped after the softmax)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if layer.alibi_slopes is not None:
        scores = scores + alibi_bias(layer.alibi_slopes.to(q.device), q.shape[1], k.shape[1], mask, torch.float32)
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    sink = layer.sinks.float().to(q.device)[:, None, None].expand(-1, q.shape[1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights, v.float()).to(q.dtype)


def paged_attention(
    query: torch.Tensor,
    cache: PagedCaches,
    metadata: AttentionMetadata,
    layer: LayerAttention,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed `query [T, H, D]` over the paged `cache` (int8: with its scales), with what `layer`
    asks for; returns `[T, H, D]`.

    `new_key`/`new_value` `[T, KVH, D]` (optional) are this step's keys as the cache holds them
    (what `write_kv_cache` returned): a sequence with no earlier context reads them directly and
    skips the gather.
    """
    def read(slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (read_context(cache.key_cache, cache.key_scales, slots, dtype),
                read_context(cache.value_cache, cache.value_scales, slots, dtype))

    stored = None if new_key is None else (new_key, new_value)
    return attend_sequences(query, read, cache.key_cache.shape[0], metadata, layer, stored, cache)


def attend_sequences(
    query: torch.Tensor,
    read: ContextReader,
    kv_heads: int,
    metadata: AttentionMetadata,
    layer: LayerAttention,
    stored: tuple[torch.Tensor, torch.Tensor] | None,
    caches: PagedCaches | None = None,
    new_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """paged_attention() with the context read by `read(slots, dtype) -> (K, V) [KVH, L, D]`, and this step's
    K/V as stored (`stored`, optional) for sequences with no earlier context. On CPU, the sequences with a few
    query rows attend in one call of the compiled kernel (cpu_paged_attention.py) over `caches` where it serves
    them; else those whose rows attend in fp32 by matmul (decode rows, few fp32 rows) attend in buckets of
    similar length (torch_buckets.py). The others (and, without the kernel, every sequence of a model with
    soft-capping, ALiBi or sinks) attend one by one. `new_rows`: the step's K/V, which the kernel's call stores
    into `caches` before anything is read (cpu_paged_attention.stores() said it can)."""
    # Masks depend on the step's shapes (and the ALiBi slopes, the same in every layer of the models that
    # use them), not on the layer, so one set serves the whole forward.
    masks = metadata.derived.setdefault("torch_masks", {})
    # Decode rows attend in fp32 (UPCAST_DECODE_DTYPES), so their context is read straight into fp32.
    upcast = query.dtype in UPCAST_DECODE_DTYPES and query.device.type == "cpu"
    widened = metadata.widened or {}  # sequences with images whose tokens attend both ways

    def attend_sequence(i: int) -> torch.Tensor:
        s, e = metadata.query_start_loc_host[i], metadata.query_start_loc_host[i + 1]
        q = query[s:e].transpose(0, 1)
        if stored is not None and e - s == metadata.seq_lens_host[i]:
            k, v = stored[0][s:e].transpose(0, 1), stored[1][s:e].transpose(0, 1)
        else:
            k, v = read(sequence_slots(metadata, i), torch.float32 if upcast and e - s == 1 else query.dtype)
        return attend_one(q, k, v, layer, masks, widened.get(i)).transpose(0, 1)

    starts = metadata.query_start_loc_host
    if caches is not None and cpu_paged_attention.serves(query, caches.key_cache):
        most_rows = cpu_paged_attention.EVERY_ROW if layer.batch_invariant else most_matmul_rows(query.dtype)
        few, rest = cpu_paged_attention.kernel_sequences(metadata, most_rows)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if len(few) or new_rows is not None:  # with no sequence of its own, the call still stores the rows
            cpu_paged_attention.attend(query, caches, metadata, few, out, layer, new_rows)
        for i in rest:
            out[starts[i]:starts[i + 1]] = attend_sequence(i)
        return out
    if layer.batch_invariant:
        raise RuntimeError("a batch-invariant step's attention needs the CPU kernel, which does not serve this "
                           f"{query.dtype} query over this cache")
    if metadata.num_seqs == 1:  # one stream: its rows are the output, with no copy into a packed buffer
        return attend_sequence(0).contiguous()
    out = torch.empty_like(query)
    rest = range(metadata.num_seqs)
    if layer.masks_only and query.device.type == "cpu" and not widened:
        plan = plan_buckets(metadata, kv_heads, query.shape[1] // kv_heads, layer, most_matmul_rows(query.dtype))
        for bucket in plan.buckets:
            out.index_copy_(0, bucket.out_rows, attend_bucket(query, read, bucket, layer.scale).to(query.dtype))
        rest = plan.rest
    for i in rest:
        out[starts[i]:starts[i + 1]] = attend_sequence(i)
    return out
