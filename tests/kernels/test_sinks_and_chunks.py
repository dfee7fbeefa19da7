"""Attention sinks (gpt-oss) and chunked attention (Llama 4) in every attention path: the PyTorch backend
(one sequence at a time, few fp32 rows, buckets of decode rows, a fresh prompt's own K/V) and the compiled
one-token path against a dense reference written the way transformers' eager attention does it, and the
Triton kernel against the PyTorch oracle (through the interpreter on CPU, fp32 and fp16; compiled on a GPU,
bf16 too), split-KV included."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401,E402  (must precede every Triton kernel import)
import pytest
import torch
from helpers.kernels import DEVICE, DTYPES, Batch, make_batch
from helpers.tolerances import tolerance
from paged_backend.kernels import (
    AttentionMetadata,
    LayerAttention,
    LayerCache,
    PagedCaches,
    dispatch,
    torch_attention,
    torch_buckets,
    triton_attention,
)
from paged_backend.kernels.torch_single_row import single_row_step, write_and_attend_single_row
from paged_backend.kernels.triton_attention import LaunchConfig

# Decode rows over similar contexts (a bucket of five), a long decode, few fp32 rows after a context, a chunk
# of a prompt after a context and a fresh prompt: every branch of the PyTorch backend.
QUERY_LENS = [1, 1, 1, 1, 1, 1, 4, 12, 9]
SEQ_LENS = [30, 33, 31, 32, 34, 70, 21, 40, 9]
KV_HEADS, GROUP, DIM, SCALE = 2, 3, 16, 0.25


def cpu_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        meta.slot_mapping.cpu(), meta.block_tables.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(),
        meta.block_size, meta.query_start_loc_host, meta.seq_lens_host, meta.max_query_len, meta.max_seq_len,
    )


def gpt_oss_sinks(heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits large enough to take a visible share of each row's weight."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0


def dense_reference(batch: Batch, scale: float, sinks: torch.Tensor | None = None, chunk: int | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Per sequence, its whole K/V read back through the block table; eager softmax with the sink appended
    as one more logit and dropped after (transformers' gpt-oss eager attention), keys before the query's
    chunk start masked (its chunked causal mask)."""
    meta = cpu_metadata(batch.metadata)
    query = batch.query.float().cpu()
    key_cache, value_cache = batch.key_cache.float().cpu(), batch.value_cache.float().cpu()
    heads = query.shape[1]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(meta.seq_lens_host):
        s, e = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        slots = [int(meta.block_tables[i, p // meta.block_size]) * meta.block_size + p % meta.block_size
                 for p in range(seq_len)]
        k = key_cache[:, slots].repeat_interleave(heads // key_cache.shape[0], dim=0)
        v = value_cache[:, slots].repeat_interleave(heads // key_cache.shape[0], dim=0)
        scores = torch.einsum("qhd,hkd->hqk", query[s:e], k) * scale
        k_pos = torch.arange(seq_len)[None, :]
        q_pos = torch.arange(seq_len - (e - s), seq_len)[:, None]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        if chunk:
            allowed &= k_pos >= (q_pos // chunk) * chunk
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().cpu()[:, None, None].expand(-1, e - s, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        out[s:e] = torch.einsum("hqk,hkd->qhd", weights, v)
    return out


def torch_backend(batch: Batch, **options) -> torch.Tensor:
    return torch_attention.paged_attention(
        batch.query.float().cpu(), PagedCaches(batch.key_cache.float().cpu(), batch.value_cache.float().cpu()),
        cpu_metadata(batch.metadata), LayerAttention(SCALE, **options), new_key=batch.new_key.float().cpu(),
        new_value=batch.new_value.float().cpu())


@pytest.fixture(scope="module")
def batch() -> Batch:
    return make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=KV_HEADS, group=GROUP, head_dim=DIM, block_size=4)


@pytest.mark.parametrize("options", [
    {"sinks": True}, {"chunk": 8}, {"chunk": 5, "window": 3}, {"sinks": True, "chunk": 8},
    {"sinks": True, "window": 7},
], ids=["sinks", "chunk", "chunk-window", "sinks-chunk", "sinks-window"])
def test_torch_backend_matches_dense_reference(batch: Batch, options: dict) -> None:
    options = {**options, "sinks": gpt_oss_sinks(KV_HEADS * GROUP) if options.get("sinks") else None}
    got = torch_backend(batch, **options)
    want = dense_reference(batch, SCALE, options["sinks"], options.get("chunk"), options.get("window"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = dense_reference(batch, SCALE)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks and chunks change the answer


def test_chunked_decode_rows_still_share_buckets(batch: Batch) -> None:
    """The chunk joins the bucket's mask: decode rows of a chunked layer attend together; a layer with sinks
    attends one by one (its softmax has one more term than the bucket's matmul)."""
    plan = torch_buckets.plan_buckets(batch.metadata, KV_HEADS, GROUP, LayerAttention(SCALE, chunk=8),
                                      torch_attention.FEW_ROWS[1])
    assert [b.seqs for b in plan.buckets] == [[6, 0, 2, 3, 1, 4]]
    metadata = cpu_metadata(batch.metadata)
    torch_backend(with_metadata(batch, metadata), sinks=gpt_oss_sinks(KV_HEADS * GROUP))
    assert not any(key[0] == "torch_buckets" for key in metadata.derived if isinstance(key, tuple))


def with_metadata(batch: Batch, metadata: AttentionMetadata) -> Batch:
    return Batch(batch.query, batch.new_key, batch.new_value, batch.key_cache, batch.value_cache, metadata)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 23])
@pytest.mark.parametrize("options", [{"sinks": True}, {"chunk": 8},
                                     {"sinks": True, "chunk": 8, "window": 5}],
                         ids=["sinks", "chunk", "all"])
def test_single_row_matches_dense_reference(length: int, options: dict) -> None:
    """The compiled one-token path's plain ops (torch_single_row.py) honour sinks and chunks as well."""
    batch = make_batch([1], [length], num_kv_heads=KV_HEADS, group=GROUP, head_dim=DIM, block_size=4, seed=length)
    sinks = gpt_oss_sinks(KV_HEADS * GROUP) if options.get("sinks") else None
    kv = torch.stack([batch.key_cache, batch.value_cache])[None].cpu()  # one layer [1, 2, KVH, slots, D]
    step = single_row_step(cpu_metadata(batch.metadata), kv)
    layer = LayerAttention(SCALE, options.get("window"), chunk=options.get("chunk"), sinks=sinks)
    out = write_and_attend_single_row(batch.query[0].cpu(), batch.new_key[0].cpu(), batch.new_value[0].cpu(), step, 0,
                                      layer)
    want = dense_reference(batch, SCALE, sinks, options.get("chunk"), options.get("window"))[0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def check_triton(batch: Batch, config: LaunchConfig | None = None, **options) -> None:
    got = triton_attention.paged_attention(batch.query, batch.caches, batch.metadata, LayerAttention(SCALE, **options),
                                           config=config)
    cpu_options = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    want = torch_attention.paged_attention(batch.query.float().cpu(),
                                           PagedCaches(batch.key_cache.float().cpu(), batch.value_cache.float().cpu()),
                                           cpu_metadata(batch.metadata), LayerAttention(SCALE, **cpu_options))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), want, **tolerance(batch.query.dtype, "kernel"))


# Decode, chunked prefill, a prefix hit and a fresh prompt, small enough for the interpreter.
TRITON_QUERY_LENS = [1, 5, 2, 7]
TRITON_SEQ_LENS = [21, 18, 35, 7]


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_sinks_match_oracle(dtype: torch.dtype) -> None:
    batch = make_batch(TRITON_QUERY_LENS, TRITON_SEQ_LENS, num_kv_heads=2, group=2, head_dim=32, block_size=5,
                       dtype=dtype)
    check_triton(batch, sinks=gpt_oss_sinks(4).to(DEVICE, dtype))
    check_triton(batch, LaunchConfig(block_m=16, tile_n=16), sinks=gpt_oss_sinks(4).to(DEVICE, dtype),
                 window=6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_chunks_match_oracle(dtype: torch.dtype) -> None:
    """Chunks of 8 and 16 with 16-key tiles: whole tiles before the chunk are skipped, the rest masked."""
    batch = make_batch(TRITON_QUERY_LENS, TRITON_SEQ_LENS, num_kv_heads=2, group=2, head_dim=32, block_size=5,
                       dtype=dtype, seed=1)
    check_triton(batch, LaunchConfig(block_m=16, tile_n=16), chunk=8)
    check_triton(batch, LaunchConfig(block_m=16, tile_n=16), chunk=16)


def test_triton_split_kv_counts_the_sink_once() -> None:
    """Split-KV decode: the sink starts the first segment's softmax state only; the merge sees it once."""
    batch = make_batch([1, 1], [70, 12], group=2, head_dim=32, block_size=16, dtype=torch.float32)
    sinks = gpt_oss_sinks(2).to(DEVICE)
    check_triton(batch, LaunchConfig(block_m=16, tile_n=16, num_segments=4), sinks=sinks)
    check_triton(batch, LaunchConfig(block_m=16, tile_n=16, num_segments=4), sinks=sinks, chunk=32)


def test_triton_rejects_wrong_sinks() -> None:
    batch = make_batch([1], [3], group=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="sinks"):
        triton_attention.paged_attention(batch.query, batch.caches, batch.metadata,
                                         LayerAttention(SCALE, sinks=torch.ones(3, device=DEVICE)))


def test_dispatcher_passes_sinks_and_chunks_to_both_backends() -> None:
    batch = make_batch([1, 6], [19, 6], num_kv_heads=2, group=2, head_dim=16, block_size=4, seed=7)
    sinks = gpt_oss_sinks(4)
    want = dense_reference(batch, SCALE, sinks, chunk=8)
    layer_cache = torch.stack([batch.key_cache, batch.value_cache])
    for backend in dispatch.BACKENDS:
        with dispatch.use_backend(backend):
            got = dispatch.write_and_attend(batch.query, batch.new_key, batch.new_value, LayerCache(layer_cache.clone()),
                                            batch.metadata, LayerAttention(SCALE, chunk=8, sinks=sinks.to(DEVICE)))
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="benchmarks/gpu_check.py's greedy section runs engines on the GPU")
@pytest.mark.parametrize("name", ["gpt_oss", pytest.param("llama4_text", marks=pytest.mark.slow)])  # one in the fast tier
def test_engine_through_triton_kernels_matches_hf_generate(name: str) -> None:
    """gpt-oss (sinks, an 8-token window) and Llama 4 (8-token chunks) with every attention on the Triton path
    (interpreted on CPU): chunked prefill, block size 5; greedy equals HF `generate`."""
    from helpers.engine import greedy, hf_greedy, run_to_completion
    from helpers.models import build

    from paged_backend import Engine, EngineConfig

    model = build(name)
    prompts = [[5, 9, 14, 3, 77, 120, 8, 61, 33, 2, 19, 40, 41], [7, 7, 100], [250, 1, 64, 64, 9, 12, 200, 17, 30]]
    expected = [hf_greedy(model, p, 5) for p in prompts]
    engine = Engine(model, config=EngineConfig(block_size=5, max_num_batched_tokens=8, num_kv_blocks=24))
    ids = [engine.add_request(p, greedy(5)) for p in prompts]
    with dispatch.use_backend("triton"):
        finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
