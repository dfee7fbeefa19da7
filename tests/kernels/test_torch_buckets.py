"""CPU attention in length buckets: the same output as attending each sequence alone, for the rows it takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from helpers.kernels import make_batch
from helpers.tolerances import tolerance
from paged_backend.kernels import (
    LayerAttention,
    PagedCaches,
    cpu_paged_attention,
    paged_attention,
    torch_attention,
    torch_buckets,
)
from paged_backend.kernels.kv_quant import quantize_int8

# Decode rows over contexts of similar and of very different lengths, three sequences verifying 2-5 rows,
# a chunk of 20 rows after a context and a fresh prompt.
QUERY_LENS = [1, 1, 1, 1, 1, 1, 1, 4, 2, 5, 20, 9]
SEQ_LENS = [30, 33, 31, 35, 90, 95, 400, 32, 34, 36, 60, 9]
KV_HEADS, GROUP = 2, 3


@pytest.fixture(autouse=True)
def torch_ops() -> Iterator[None]:
    """Buckets serve where the compiled CPU kernel does not (no compiler): these tests attend without it."""
    with cpu_paged_attention.switched_off():
        yield


def one_by_one(monkeypatch: pytest.MonkeyPatch, query, cache, metadata, layer):
    """paged_attention() with every sequence attended alone (a fresh step memo: the plan is kept there)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch_buckets, "MIN_BUCKET", 10**9)
        fresh = dataclasses.replace(metadata, derived={})
        out = paged_attention(query, cache, fresh, layer)
    assert not any(plan.buckets for key, plan in fresh.derived.items() if key[0] == "torch_buckets")
    return out


@pytest.mark.parametrize("window", [None, 7])
def test_buckets_match_attending_one_by_one(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=KV_HEADS, group=GROUP, head_dim=16, block_size=4)
    args = (batch.query, batch.caches, batch.metadata, LayerAttention(0.25, window))
    got = paged_attention(*args)
    plan = torch_buckets.plan_buckets(batch.metadata, KV_HEADS, GROUP, args[-1], torch_attention.FEW_ROWS[1])
    # The 30-36 key rows are one bucket, decode and verification rows alike (padded to 5 rows each); the 90
    # and 95 key rows are too few for one (and would pad the others past 15 % of their keys); the 400-key
    # row, the chunk and the fresh prompt attend alone.
    assert [(b.rows_per_seq, b.seqs) for b in plan.buckets] == [(5, [0, 2, 7, 1, 8, 3, 9])]
    assert plan.rest == [4, 5, 6, 10, 11]
    for bucket in plan.buckets:  # padding re-reads a slot the sequence wrote, never another's or a spare one
        for seq, slots in zip(bucket.seqs, bucket.slots.view(len(bucket.seqs), bucket.length).tolist()):
            assert set(slots) == set(slots[:SEQ_LENS[seq]])
    want = one_by_one(monkeypatch, *args)
    assert torch.isfinite(got).all()  # the cache's unwritten slots hold NaN: padding never reads them
    torch.testing.assert_close(got, want, **tolerance(torch.float32, "kernel"))


def test_low_precision_buckets_take_decode_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 decode rows attend in fp32 either way, so they share buckets; a bf16 model's verification
    rows keep SDPA in bf16, one by one."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=KV_HEADS, group=GROUP, head_dim=16, block_size=4,
                       dtype=torch.bfloat16)
    args = (batch.query, batch.caches, batch.metadata, LayerAttention(0.25))
    got = paged_attention(*args)
    plan = torch_buckets.plan_buckets(batch.metadata, KV_HEADS, GROUP, args[-1], 1)
    assert [(b.rows_per_seq, b.seqs, b.kept) for b in plan.buckets] == [(1, [0, 2, 1, 3], None)]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, one_by_one(monkeypatch, *args), **tolerance(torch.bfloat16, "kernel"))


def test_int8_cache_buckets_dequantize_like_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=KV_HEADS, group=GROUP, head_dim=16, block_size=4)
    finite = [torch.nan_to_num(c) for c in (batch.key_cache, batch.value_cache)]
    (key_codes, key_scales), (value_codes, value_scales) = (quantize_int8(c) for c in finite)
    args = (batch.query, PagedCaches(key_codes, value_codes, key_scales, value_scales), batch.metadata,
            LayerAttention(0.25))
    got = paged_attention(*args)
    assert torch_buckets.plan_buckets(batch.metadata, KV_HEADS, GROUP, args[-1], torch_attention.FEW_ROWS[1]).buckets
    torch.testing.assert_close(got, one_by_one(monkeypatch, *args), **tolerance(torch.float32, "kernel"))


def test_soft_capped_layers_attend_one_by_one() -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=KV_HEADS, group=GROUP, head_dim=16, block_size=4)
    paged_attention(batch.query, batch.caches, batch.metadata, LayerAttention(0.25, softcap=20.0))
    assert not any(key[0] == "torch_buckets" for key in batch.metadata.derived if isinstance(key, tuple))


def test_split_by_length_bounds_padding_and_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    lens = [10, 10, 11, 12, 30, 31, 100]
    assert torch_buckets.split_by_length(list(range(7)), lens) == [[0, 1, 2, 3], [4, 5], [6]]
    monkeypatch.setattr(torch_buckets, "MAX_BUCKET_KEYS", 40)
    assert torch_buckets.split_by_length(list(range(7)), lens) == [[0, 1, 2], [3], [4], [5], [6]]
