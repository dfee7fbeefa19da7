"""Many sequences' few query rows attend together on CPU, in buckets of similar context length, where the
compiled CPU kernel (cpu_paged_attention.py) is not built (no C compiler) or is switched off.

Attending one sequence at a time, a decode step of 32 sequences pays per sequence and layer for a gather,
a cast and an SDPA call, whose cost at a decode step's context lengths is mostly fixed overhead rather
than arithmetic. In a bucket, sequences of similar context lengths attend together: one gather of all their
contexts (each padded to the bucket's longest, the padding masked), one cast to fp32 and two batched
matmuls. A sequence with fewer query rows than the bucket's most repeats its last row; the repeats are
dropped. On the throughput workload buckets raised the engine's tokens/s in fp32 (the same tokens) and with
int4 weights in bf16, and the rate of streams verifying n-gram proposals (docs/design.md has the
measurements).

Which sequences go into buckets: those attended in fp32 by a matmul anyway. That is one decode row
(bf16/fp16 decode rows are upcast, see torch_attention.UPCAST_DECODE_DTYPES), or up to 16 fp32 rows
(torch_attention.FEW_ROWS, e.g. a request verifying proposed tokens), over an earlier context, with no
soft-capping, ALiBi or attention sinks (a chunked layer's chunk joins the window in the mask). A bucket
needs MIN_BUCKET sequences; the rest attend one by one, so a lone stream keeps reading its context as a
view of the cache. MIN_BUCKET and MAX_PADDING are reasoned
choices, not tuned ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .layer_attention import LayerAttention
from .metadata import AttentionMetadata, host_block_tables

MIN_BUCKET = 4  # fewer sequences than this attend one by one
MAX_PADDING = 0.15  # a bucket takes no sequence that would make padding more than this share of its keys
MAX_BUCKET_KEYS = 16384  # bounds one bucket's gathered context (16k keys x 2 x KV heads x head dim in fp32)

# Reads the K and V `[KVH, L, D]` at a sequence's slots (an index tensor, or a slice: a view of the cache).
ContextReader = Callable[[torch.Tensor | slice, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class Bucket:
    seqs: list[int]  # the step's sequence indices, by ascending context length
    rows_per_seq: int  # n, the most query rows one of them has; a sequence with fewer repeats its last row
    length: int  # keys per sequence, padded (the longest context of the bucket)
    query_rows: torch.Tensor  # [len(seqs) * n] the packed query row each bucket row reads, sequence by sequence
    kept: torch.Tensor | None  # the bucket rows that are no repeat (None: all), in the order of out_rows
    out_rows: torch.Tensor  # where those rows go in the packed output
    slots: torch.Tensor  # [len(seqs) * length] cache slots of each context, padded with its first slot
    bias: torch.Tensor  # [KVH * len(seqs), group * n, length] fp32: 0 where a row sees a key, else -inf


@dataclass(slots=True)
class BucketPlan:
    buckets: list[Bucket]
    rest: list[int]  # sequences attended one by one


def plan_buckets(metadata: AttentionMetadata, kv_heads: int, group: int, layer: LayerAttention,
                 most_rows: int) -> BucketPlan:
    """The step's buckets of sequences with at most `most_rows` query rows over an earlier context, masked by
    `layer`'s window and chunk, memoised for every layer of the forward with the same shapes, window and chunk."""
    key = ("torch_buckets", kv_heads, group, layer.window, most_rows, layer.chunk)
    plan = metadata.derived.get(key)
    if plan is None:
        plan = metadata.derived[key] = build_plan(metadata, kv_heads, group, layer, most_rows)
    return plan


def build_plan(metadata: AttentionMetadata, kv_heads: int, group: int, layer: LayerAttention,
               most_rows: int) -> BucketPlan:
    starts, lens = metadata.query_start_loc_host, metadata.seq_lens_host
    eligible = [i for i, seq_len in enumerate(lens) if starts[i + 1] - starts[i] <= min(most_rows, seq_len - 1)]
    eligible.sort(key=lens.__getitem__)
    runs = [run for run in split_by_length(eligible, lens) if len(run) >= MIN_BUCKET]
    buckets = [make_bucket(run, metadata, kv_heads, group, layer) for run in runs]
    bucketed = {i for bucket in buckets for i in bucket.seqs}
    return BucketPlan(buckets, [i for i in range(len(lens)) if i not in bucketed])


def split_by_length(seqs: list[int], lens: list[int]) -> list[list[int]]:
    """`seqs` (ascending by length) cut into runs whose padding to their longest stays under MAX_PADDING of
    their keys and whose keys stay under MAX_BUCKET_KEYS."""
    runs: list[list[int]] = []
    current: list[int] = []
    keys = 0
    for i in seqs:
        padded = lens[i] * (len(current) + 1)
        if current and (padded * (1 - MAX_PADDING) > keys + lens[i] or padded > MAX_BUCKET_KEYS):
            runs.append(current)
            current, keys = [], 0
        current.append(i)
        keys += lens[i]
    if current:
        runs.append(current)
    return runs


def make_bucket(seqs: list[int], metadata: AttentionMetadata, kv_heads: int, group: int,
                layer: LayerAttention) -> Bucket:
    """The bucket of `seqs`, its mask from `layer`'s window and chunk (its scale is applied when it attends)."""
    starts = np.array([metadata.query_start_loc_host[i] for i in seqs])
    counts = np.array([metadata.query_start_loc_host[i + 1] for i in seqs]) - starts
    lens = np.array([metadata.seq_lens_host[i] for i in seqs])
    n, length, bs = int(counts.max()), int(lens.max()), metadata.block_size
    positions = np.arange(length)
    slots = host_block_tables(metadata)[seqs][:, positions // bs].astype(np.int64) * bs + positions % bs
    # Padding reads the sequence's own first slot: written, so finite (the cache's unwritten slots may hold
    # NaN, and NaN times a softmax weight of 0 is still NaN).
    slots = np.where(positions < lens[:, None], slots, slots[:, :1])
    row = np.minimum(np.arange(n), counts[:, None] - 1)  # [seqs, n]: a repeat of the last row past the real ones
    query_positions = (lens - counts)[:, None] + row
    allowed = positions <= query_positions[..., None]  # [seqs, n, length]; padding lies past every query
    if layer.window is not None:
        allowed &= positions > query_positions[..., None] - layer.window
    if layer.chunk is not None:
        allowed &= positions >= (query_positions - query_positions % layer.chunk)[..., None]
    bias = torch.zeros(allowed.shape).masked_fill_(torch.from_numpy(~allowed), float("-inf"))
    # One KV head's matmul holds its group of query heads, each with the sequence's n rows.
    bias = bias[None, :, None].expand(kv_heads, len(seqs), group, n, length).reshape(-1, group * n, length)
    real = np.arange(n) < counts[:, None]
    device = metadata.block_tables.device

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64).ravel()).to(device)

    return Bucket(seqs, n, length, tensor(starts[:, None] + row), None if real.all() else tensor(np.flatnonzero(real)),
                  tensor((starts[:, None] + row)[real]), tensor(slots), bias.contiguous().to(device))


def attend_bucket(query: torch.Tensor, read: ContextReader, bucket: Bucket, scale: float) -> torch.Tensor:
    """Attention of the bucket's rows of packed `query [T, H, D]` over their contexts, read by `read(slots,
    dtype) -> (K, V) [KVH, len(slots), D]`; returns the rows for `bucket.out_rows`, `[len(out_rows), H, D]`,
    in fp32."""
    count, n, length = len(bucket.seqs), bucket.rows_per_seq, bucket.length
    keys, values = read(bucket.slots, torch.float32)
    kv_heads, dim = keys.shape[0], keys.shape[-1]
    group = query.shape[1] // kv_heads
    q = query.index_select(0, bucket.query_rows).float().view(count, n, kv_heads, group, dim)
    q = q.permute(2, 0, 3, 1, 4).reshape(kv_heads * count, group * n, dim)
    scores = torch.baddbmm(bucket.bias, q, keys.reshape(-1, length, dim).transpose(1, 2), alpha=scale)
    out = torch.bmm(scores.softmax(-1), values.reshape(-1, length, dim))
    out = out.view(kv_heads, count, group, n, dim).permute(1, 3, 0, 2, 4).reshape(count * n, -1, dim)
    return out if bucket.kept is None else out.index_select(0, bucket.kept)
