"""Multi-head latent attention's write and attention (dispatch.write_and_attend_latent) on both backends: each
token's latent row is written once into a cache of one plane and one head, and every query head attends over
the latents as keys and values alike. The PyTorch backend against a dense reference, the Triton kernels
against the PyTorch backend (through the interpreter on CPU, fp32 and fp16; compiled on a GPU, bf16 too),
an int8 cache included; and the tiny DeepSeek-V3 model through the Triton kernels against HF generate."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must precede every Triton kernel import)
import pytest
import torch
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.kernels import DEVICE, DTYPES, make_batch
from helpers.models import build
from helpers.tolerances import tolerance

from paged_backend import Engine, EngineConfig
from paged_backend.kernels import LayerAttention, LayerCache, dispatch

# A decode row, a chunk after a cached context, a fresh prompt; 4 query heads over a latent of 32 + 16.
QUERY_LENS, SEQ_LENS = [1, 3, 5], [9, 7, 5]
HEADS, LATENT, RANK, SCALE = 4, 48, 32, 0.2


def latent_step(dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """(query [T, H, D], latent [T, 1, D], layer cache [1, 1, slots, D] with the context written and the step's
    slots NaN, its scales or None, metadata)."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=1, group=HEADS, head_dim=LATENT, block_size=4, dtype=dtype)
    cache = batch.key_cache.clone()
    cache[:, batch.metadata.slot_mapping] = float("nan")
    scales = None
    if cache_dtype == torch.int8:
        from paged_backend.kernels.kv_quant import quantize_int8

        values, row_scales = quantize_int8(torch.nan_to_num(cache.transpose(0, 1), nan=0.0))
        cache, scales = values.transpose(0, 1).contiguous(), row_scales.transpose(0, 1).contiguous()[None]
    return batch.query, batch.new_key, cache[None], scales, batch.metadata


def run(backend: str, query, latent, cache, scales, metadata) -> tuple[torch.Tensor, torch.Tensor]:
    cache = cache.clone()
    with dispatch.use_backend(backend):
        out = dispatch.write_and_attend_latent(query, latent, LayerCache(cache, None if scales is None else scales.clone()),
                                               metadata, LayerAttention(SCALE))
    return out, cache


def dense_reference(query: torch.Tensor, cache: torch.Tensor, metadata) -> torch.Tensor:
    """Per sequence, fp32: each head's query over the sequence's latent rows (read through its block table) as
    keys, their first RANK columns as values, causal."""
    out = []
    tables, bs = metadata.block_tables.cpu(), metadata.block_size
    for i, seq_len in enumerate(metadata.seq_lens_host):
        s, e = metadata.query_start_loc_host[i], metadata.query_start_loc_host[i + 1]
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(seq_len)])
        rows = cache[0, 0, slots].float().cpu()
        q = query[s:e].float().cpu()  # [n, H, D]
        scores = torch.einsum("nhd,ld->hnl", q, rows) * SCALE
        q_pos = torch.arange(seq_len - (e - s), seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hnl,lr->nhr", scores.softmax(-1), rows[:, :RANK]))
    return torch.cat(out)


def test_torch_backend_writes_the_latent_once_and_attends_over_it():
    query, latent, cache, _, metadata = latent_step(torch.float32)
    out, written = run("torch", query, latent, cache, None, metadata)
    assert torch.equal(written[0, 0, metadata.slot_mapping], latent[:, 0])
    assert out.shape == (sum(QUERY_LENS), HEADS, LATENT)
    torch.testing.assert_close(out[..., :RANK], dense_reference(query, written, metadata),
                               **tolerance(torch.float32, "kernel"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_equal_the_torch_backend(dtype):
    query, latent, cache, _, metadata = latent_step(dtype)
    want, want_cache = run("torch", query, latent, cache, None, metadata)
    got, got_cache = run("triton", query, latent, cache, None, metadata)
    assert torch.equal(got_cache[0, 0, metadata.slot_mapping], want_cache[0, 0, metadata.slot_mapping])
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype, "kernel"))


def test_triton_kernels_read_an_int8_latent_cache():
    query, latent, cache, scales, metadata = latent_step(torch.float32, torch.int8)
    want, want_cache = run("torch", query, latent, cache, scales, metadata)
    got, got_cache = run("triton", query, latent, cache, scales, metadata)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, "kernel"))


def test_deepseek_v3_through_the_triton_kernels_matches_hf(monkeypatch):
    model = build("deepseek_v3").to(DEVICE)
    prompts = mixed_prompts(3, seed=2)
    expected = [hf_greedy(model, p, 6) for p in prompts]
    kernels, launches = dispatch.triton_modules()[0], []
    kernel = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: launches.append(a[0].shape) or kernel(*a, **k))
    with dispatch.use_backend("triton"):
        engine = Engine(model, config=EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=24))
        ids = [engine.add_request(p, greedy(6)) for p in prompts]
        finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert launches and all(shape[1:] == (HEADS, LATENT) for shape in launches)
    assert_all_blocks_free(engine)
