"""ALiBi in both attention backends: the PyTorch backend against a dense reference written the way
the models write it (absolute `slope * key_pos`), and the Triton kernel against the PyTorch oracle
(through the interpreter on CPU, fp32 and fp16; compiled on a GPU, bf16 too)."""

from __future__ import annotations

import os
import sys

import helpers.triton_interpret  # noqa: F401,E402  (must precede every Triton kernel import)
import pytest
import torch
from helpers.kernels import DEVICE, DTYPES, Batch, make_batch
from helpers.tolerances import tolerance
from paged_backend.kernels import (
    AttentionMetadata,
    LayerAttention,
    PagedCaches,
    dispatch,
    torch_attention,
    triton_attention,
)
from paged_backend.kernels.triton_attention import LaunchConfig


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes (BLOOM, Falcon-RW, Baichuan-13B), with the interleave for heads
    that are not a power of two."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(num_heads, torch.device("cpu")).float()


def cpu_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        meta.slot_mapping.cpu(), meta.block_tables.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(),
        meta.block_size, meta.query_start_loc_host, meta.seq_lens_host, meta.max_query_len, meta.max_seq_len,
    )


def oracle(batch: Batch, scale: float, slopes: torch.Tensor, **options) -> torch.Tensor:
    return torch_attention.paged_attention(
        batch.query.float().cpu(), PagedCaches(batch.key_cache.float().cpu(), batch.value_cache.float().cpu()),
        cpu_metadata(batch.metadata), LayerAttention(scale, alibi_slopes=slopes, **options),
    )


def dense_reference(batch: Batch, scale: float, slopes: torch.Tensor, softcap: float | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Per sequence, the whole K/V read back through the block table, eager softmax with the
    absolute bias `slope * key_pos` that BLOOM / Baichuan add."""
    meta = cpu_metadata(batch.metadata)
    query, key_cache, value_cache = batch.query.float().cpu(), batch.key_cache.float().cpu(), batch.value_cache.float().cpu()
    heads = query.shape[1]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(meta.seq_lens_host):
        s, e = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        slots = [int(meta.block_tables[i, p // meta.block_size]) * meta.block_size + p % meta.block_size
                 for p in range(seq_len)]
        k = key_cache[:, slots].repeat_interleave(heads // key_cache.shape[0], dim=0)
        v = value_cache[:, slots].repeat_interleave(heads // key_cache.shape[0], dim=0)
        scores = torch.einsum("qhd,hkd->hqk", query[s:e], k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        k_pos = torch.arange(seq_len)[None, :]
        q_pos = torch.arange(seq_len - (e - s), seq_len)[:, None]
        scores = scores + slopes[:, None, None] * k_pos
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[s:e] = torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v)
    return out


def check_triton(batch: Batch, slopes: torch.Tensor, config: LaunchConfig | None = None, **options) -> None:
    scale = batch.query.shape[-1] ** -0.5
    got = triton_attention.paged_attention(batch.query, batch.caches, batch.metadata,
                                           LayerAttention(scale, alibi_slopes=slopes.to(DEVICE), **options), config=config)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), oracle(batch, scale, slopes, **options),
                               **tolerance(batch.query.dtype, "kernel"))


# Decode, chunked prefill, prefix hit, fresh prefill: the bias must follow each row's own position.
QUERY_LENS = [1, 5, 2, 7]
SEQ_LENS = [21, 18, 35, 7]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1), (12, 12)])
def test_torch_backend_matches_dense_reference(heads: int, kv_heads: int) -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=kv_heads, group=heads // kv_heads, head_dim=16,
                       block_size=4, seed=heads)
    slopes = bloom_slopes(heads)
    scale = 0.25
    got = oracle(batch, scale, slopes)
    torch.testing.assert_close(got, dense_reference(batch, scale, slopes), **tolerance(torch.float32, "kernel"))


def test_torch_backend_alibi_with_window_and_softcap() -> None:
    batch = make_batch([1, 6], [20, 9], num_kv_heads=2, group=2, head_dim=16, block_size=4, seed=5)
    slopes = bloom_slopes(4)
    got = oracle(batch, 0.25, slopes, window=5, softcap=3.0)
    torch.testing.assert_close(got, dense_reference(batch, 0.25, slopes, softcap=3.0, window=5),
                               **tolerance(torch.float32, "kernel"))


def test_torch_backend_fresh_prefill_fast_path_has_alibi() -> None:
    """A sequence with no context reads this step's K/V directly (no gather): the bias still applies."""
    batch = make_batch([9], [9], num_kv_heads=2, group=2, head_dim=16, block_size=4, seed=2)
    slopes = bloom_slopes(4)
    got = torch_attention.paged_attention(batch.query, batch.caches, batch.metadata,
                                          LayerAttention(0.25, alibi_slopes=slopes), new_key=batch.new_key,
                                          new_value=batch.new_value)
    plain = torch_attention.paged_attention(batch.query, batch.caches, batch.metadata, LayerAttention(0.25),
                                            new_key=batch.new_key, new_value=batch.new_value)
    torch.testing.assert_close(got, dense_reference(batch, 0.25, slopes), **tolerance(torch.float32, "kernel"))
    assert not torch.allclose(got, plain, atol=1e-3)  # the slopes are big enough to matter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_triton_alibi_matches_oracle(group: int, dtype: torch.dtype) -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=group, head_dim=32,
                       block_size=16 if group % 2 else 5, dtype=dtype, seed=group)
    check_triton(batch, bloom_slopes(2 * group))


def test_triton_alibi_split_kv_and_window() -> None:
    batch = make_batch([1, 1], [70, 12], group=2, head_dim=32, block_size=16, dtype=torch.float32)
    check_triton(batch, bloom_slopes(2), LaunchConfig(block_m=16, tile_n=16, num_segments=4))
    check_triton(batch, bloom_slopes(2), LaunchConfig(block_m=16, tile_n=16), window=20)


def test_triton_rejects_wrong_slopes() -> None:
    batch = make_batch([1], [3], group=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="alibi_slopes"):
        triton_attention.paged_attention(batch.query, batch.caches, batch.metadata,
                                         LayerAttention(0.25, alibi_slopes=torch.ones(3, device=DEVICE)))


def test_dispatcher_passes_slopes_to_both_backends() -> None:
    batch = make_batch([1, 4], [11, 4], num_kv_heads=2, group=2, head_dim=16, block_size=4, seed=7)
    slopes = bloom_slopes(4).to(DEVICE)
    want = dense_reference(batch, 0.25, slopes.cpu())
    for backend in dispatch.BACKENDS:
        with dispatch.use_backend(backend):
            got = dispatch.paged_attention(batch.query, batch.caches, batch.metadata,
                                           LayerAttention(0.25, alibi_slopes=slopes), new_key=batch.new_key,
                                           new_value=batch.new_value)
        torch.testing.assert_close(got.float().cpu(), want, **tolerance(torch.float32, "kernel"))


# As test_kernels.py's compile check, for the ALiBi kernel: compiled for sm_90 in a fresh process
# (this one interprets triton.language), to catch what only the compiler rejects.
COMPILE_ALIBI_FOR_HOPPER = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_backend.kernels import triton_attention

kernel = triton_attention.paged_attention_alibi_kernel
signature = {name: "*bf16" for name in ("out_ptr", "q_ptr", "key_cache_ptr", "value_cache_ptr")}
signature.update({name: "*i32" for name in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")})
signature.update({name: "*fp32" for name in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr", "alibi_ptr",
                                             "key_scale_ptr", "value_scale_ptr")})
signature.update({"sinks_ptr": "*bf16"})
signature.update({name: "i32" for name in ("sliding_window", "chunk_size", "num_seqs", "block_size", "num_heads", "head_dim",
                                            "stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h",
                                            "stride_c_slot", "stride_bt", "stride_s_h")})
signature.update({"scale": "fp32", "softcap": "fp32", "stride_c_h": "i64"})
constexprs = dict(GROUP=4, GROUP_PAD=4, BLOCK_M=16, TILE_N=32, HEAD_PAD=64, NUM_SEGMENTS=4,
                  USE_SOFTCAP=False, USE_WINDOW=False, KV_INT8=False, USE_SINKS=False, USE_CHUNK=False)
signature.update({name: "constexpr" for name in constexprs})
positions = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=positions),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
assert "mma" in compiled.asm["ptx"]
print("compiled")
"""


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the tests above compile the kernel for real")
def test_alibi_kernel_compiles_for_hopper() -> None:
    import subprocess

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", COMPILE_ALIBI_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the engine reaches the compiled kernel by itself")
@pytest.mark.parametrize("name", [pytest.param("bloom", marks=pytest.mark.slow), "falcon-40b"])  # one in the fast tier
def test_adapted_engine_through_triton_kernels_matches_hf_generate(name: str) -> None:
    """An adapted model with every attention call on the Triton path (interpreted on CPU): ALiBi
    (BLOOM) and grouped KV (falcon-40b); chunked prefill with block size 5; greedy equals `generate`."""
    from helpers.adapters import build_adapted
    from helpers.engine import greedy, hf_greedy, run_to_completion

    from paged_backend import Engine, EngineConfig

    model = build_adapted(name)
    prompts = [[5, 9, 14, 3, 77, 120, 8, 61, 33, 2, 19, 40, 41], [7, 7, 100], [250, 1, 64, 64, 9, 12, 200]]
    expected = [hf_greedy(model, p, 5) for p in prompts]
    engine = Engine(model, config=EngineConfig(block_size=5, max_num_batched_tokens=8, num_kv_blocks=24))
    ids = [engine.add_request(p, greedy(5)) for p in prompts]
    with dispatch.use_backend("triton"):
        finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
