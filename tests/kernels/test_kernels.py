"""Triton kernels against the PyTorch oracle.

Without CUDA the kernels run through the Triton interpreter on CPU tensors (fp32 and fp16; the
interpreter computes bf16 wrongly, so bf16 runs only on a GPU). Batches are tiny because the
interpreter costs about 10 ms per program iteration.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import helpers.triton_interpret  # noqa: F401,E402  (must precede every Triton kernel import)
import pytest
import torch
from helpers.kernels import DEVICE, DTYPES, Batch, check_attention, make_batch, oracle
from helpers.tolerances import tolerance
from paged_backend.kernels import (
    LayerAttention,
    dispatch,
    torch_attention,
    triton_attention,
    triton_cache_write,
)
from paged_backend.kernels.triton_attention import LaunchConfig

# decode, chunked prefill (context + a slice), prefix hit (long context, short new part), fresh
# prefill; lengths not multiples of the block size.
MIXED_QUERY_LENS = [1, 5, 2, 7]
MIXED_SEQ_LENS = [21, 18, 35, 7]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_mixed_batch_matches_oracle(group: int, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_kv_heads=2 if group < 4 else 1, group=group,
                       block_size=16 if group % 2 else 5, dtype=dtype, seed=group)
    check_attention(batch)


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_head_sizes(head_dim: int) -> None:
    batch = make_batch([1, 3], [9, 3], group=2, head_dim=head_dim, block_size=4, dtype=torch.float16)
    check_attention(batch)


def test_prefill_tiles_with_several_query_blocks() -> None:
    """64-row blocks cut a long prefill into several query blocks (and a spare one per sequence)."""
    batch = make_batch([1, 40, 3], [50, 40, 12], group=2, block_size=16, dtype=torch.float16)
    check_attention(batch, LaunchConfig(block_m=32, tile_n=16))
    check_attention(batch, LaunchConfig(block_m=64, tile_n=64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window(dtype: torch.dtype) -> None:
    """Windows shorter than the context skip whole tiles and mask inside them."""
    batch = make_batch([1, 6, 4], [40, 30, 4], group=2, block_size=8, dtype=dtype)
    check_attention(batch, LaunchConfig(block_m=16, tile_n=16), window=7)


def test_window_hides_whole_tiles_from_some_rows() -> None:
    """In a 32-token query block with a 4-token window, late rows see nothing in the block's first
    tiles: their running max stays -inf there, which must not turn into NaN."""
    batch = make_batch([40], [40], group=2, block_size=16, dtype=torch.float32)
    check_attention(batch, LaunchConfig(block_m=64, tile_n=16), window=4)


def test_softcap() -> None:
    batch = make_batch([1, 6], [20, 6], group=2, block_size=16, dtype=torch.float32, seed=3)
    batch.query.mul_(8.0)  # push logits into tanh's saturating range
    check_attention(batch, softcap=5.0)


@pytest.mark.parametrize("segments", [2, 4])
def test_split_kv_decode(segments: int) -> None:
    """Split-KV: segments of an uneven number of tiles, and segments left empty by short contexts."""
    batch = make_batch([1, 1, 1], [70, 3, 33], num_kv_heads=2, group=4, block_size=16, dtype=torch.float16)
    check_attention(batch, LaunchConfig(block_m=16, tile_n=16, num_segments=segments))


def test_fixed_segment_count_of_a_captured_step() -> None:
    """A padded decode step carries its segment count (a CUDA graph replays one grid whatever the context):
    the launch follows it, and padding-like one-token rows with short contexts leave segments empty."""
    batch = make_batch([1, 1, 1, 1], [70, 1, 1, 5], num_kv_heads=2, group=2, block_size=16, dtype=torch.float32)
    assert triton_attention.choose_config(batch.query, 2, batch.metadata).num_segments == 1  # CPU: not split
    batch.metadata.num_kv_segments = 4
    assert triton_attention.choose_config(batch.query, 2, batch.metadata).num_segments == 4
    check_attention(batch)


def test_split_kv_with_window() -> None:
    batch = make_batch([1, 1], [70, 12], group=2, block_size=16, dtype=torch.float32)
    check_attention(batch, LaunchConfig(block_m=16, tile_n=16, num_segments=4), window=20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_matches_oracle_and_skips_negative_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, kv_heads, head_dim, slots = 6, 3, 80, 40
    key = torch.randn(kv_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(kv_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    slot_mapping = torch.tensor([17, -1, 3, 39, -1, 0], dtype=torch.int64)
    caches = torch.full((2, kv_heads, slots, head_dim), float("nan"), dtype=dtype)
    expected = caches.clone()
    torch_attention.write_kv_cache(key, value, expected[0], expected[1], slot_mapping)
    caches, slot_mapping = caches.to(DEVICE), slot_mapping.to(DEVICE)
    triton_cache_write.write_kv_cache(key.to(DEVICE), value.to(DEVICE), caches[0], caches[1], slot_mapping)
    torch.testing.assert_close(caches.cpu(), expected, atol=0, rtol=0, equal_nan=True)
    assert torch.isnan(caches[:, :, 1]).all()  # a slot nobody wrote stays untouched


def test_cache_write_then_attention_round_trip() -> None:
    """The two kernels together, as the engine calls them per layer."""
    batch = make_batch([1, 4], [11, 4], num_kv_heads=2, group=2, block_size=4, dtype=torch.float16, seed=7)
    meta = batch.metadata
    caches = torch.stack([batch.key_cache, batch.value_cache]).clone()
    caches[:, :, meta.slot_mapping] = float("nan")  # forget the new tokens, then write them back
    triton_cache_write.write_kv_cache(batch.new_key, batch.new_value, caches[0], caches[1], meta.slot_mapping)
    torch.testing.assert_close(caches, torch.stack([batch.key_cache, batch.value_cache]), equal_nan=True)
    check_attention(Batch(batch.query, batch.new_key, batch.new_value, caches[0], caches[1], meta))


def test_dispatcher_routes_by_device() -> None:
    assert dispatch.select_backend(torch.device("cpu"), torch.float16, 64) == "torch"
    assert dispatch.select_backend(torch.device("cuda"), torch.float16, 64) == "triton"
    assert dispatch.select_backend(torch.device("cuda"), torch.float64, 64) == "torch"
    assert dispatch.select_backend(torch.device("cuda"), torch.float16, 512) == "torch"


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU path is what this checks")
def test_dispatcher_cpu_path_is_the_oracle() -> None:
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_kv_heads=2, group=2, dtype=torch.float32)
    scale = 0.125
    got = dispatch.paged_attention(batch.query, batch.caches, batch.metadata, LayerAttention(scale),
                                   new_key=batch.new_key, new_value=batch.new_value)
    torch.testing.assert_close(got, oracle(batch, scale), **tolerance(batch.query.dtype, "kernel"))


def test_interpreter_is_on_without_cuda() -> None:
    """Guards the set-up above: without it the kernels would not run at all on CPU."""
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(triton_attention.paged_attention_kernel, InterpretedFunction)
        assert isinstance(triton_cache_write.write_kv_kernel, InterpretedFunction)


def test_use_backend_forces_a_backend_and_restores_routing() -> None:
    cpu = torch.device("cpu")
    with dispatch.use_backend("triton"):
        assert dispatch.select_backend(cpu, torch.float32, 64) == "triton"
    assert dispatch.select_backend(cpu, torch.float32, 64) == "torch"
    with pytest.raises(ValueError, match="flash"), dispatch.use_backend("flash"):
        pass


@pytest.mark.skipif(DEVICE.type == "cuda", reason="benchmarks/gpu_check.py's greedy section runs this on the GPU")
def test_engine_through_triton_kernels_matches_hf_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with every attention and cache write on the Triton path (interpreted on CPU):
    chunked prefill, block size 5 not dividing the lengths, GQA 2; greedy equals HF `generate`."""
    from helpers.engine import greedy, hf_greedy, run_to_completion
    from helpers.models import build

    from paged_backend import Engine, EngineConfig

    model = build("llama")
    prompts = [[5, 9, 14, 3, 77, 120, 8, 61, 33, 2, 19, 40, 41], [7, 7, 100], [250, 1, 64, 64, 9, 12, 200]]
    expected = [hf_greedy(model, p, 5) for p in prompts]
    calls = []
    kernel = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    engine = Engine(model, config=EngineConfig(block_size=5, max_num_batched_tokens=8, num_kv_blocks=24))
    ids = [engine.add_request(p, greedy(5)) for p in prompts]
    with dispatch.use_backend("triton"):
        finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert calls, "the Triton kernel never ran"


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU, run the script itself")
def load_gpu_check(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/gpu_check.py as a module (a script, not a package module)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    return gpu_check


@pytest.mark.slow  # runs the GPU check script in a process of its own: the slow tier
def test_gpu_check_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_check.py cannot run on a GPU here; its dry run takes every section's code path at
    toy sizes (kernels interpreted) and compares the kernel with SDPA on the gathered data."""
    gpu_check = load_gpu_check(monkeypatch)
    out = tmp_path / "gpu_check.json"
    # greedy is left out: test_engine_through_triton_kernels_matches_hf_generate covers that path.
    assert gpu_check.main(["--dry-run", "--only", "kernel_tests,micro,throughput", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["micro"]["decode"]["max_abs_err"] < 1e-4
    assert report["micro"]["split_kv"]["segments"] > 1
    assert report["throughput"]["systems"]["engine"]["tokens"] == 4 * 3


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU, run the script itself")
def test_gpu_check_steps_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps sections on CPU: eager, compiled and padded (the captured variant's CPU part) engines agree
    token for token and teacher-forced, and the report carries what a GPU run reads (capture itself needs CUDA)."""
    gpu_check = load_gpu_check(monkeypatch)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--only", "steps,steps_fp32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps = report["steps"]
    variants = steps["variants"]
    assert variants["compiled"]["compile_s"] > 0 and variants["eager"]["compile_s"] is None
    assert variants["compiled"]["compiled"] and variants["compiled"]["fast_path_check"]["passed"]
    # Teacher-forced along eager's tokens through each variant's own steps: in fp32 the same log-probabilities.
    for name in ("compiled", "captured"):
        forced = variants[name]["teacher_forced"]
        assert forced["tokens"] == 4 * 3 and forced["argmax_agreement"] == 1.0 and forced["max_abs_dlogp"] < 1e-4
    layers = variants["compiled"]["layers"]  # every layer's attention, compiled against eager: none past the bound
    assert len(layers["per_layer"]) == 2 and layers["first_layer_past_bound"] is None
    assert all(v["tokens_equal_eager"]["equal"] == 4 for n, v in report["steps_fp32"]["variants"].items()
               if n != "eager")
    assert variants["captured"]["padded_steps"] > 0 and not variants["captured"]["captured"]
    assert variants["captured"]["tokens_equal_eager"] == {"equal": 4, "of": 4, "first_mismatch": None}
    assert steps["bare_forward"]["batch"] == variants["captured"]["decode_step_ms"][0] > 0
    assert steps["decode_step_over_bare_graph"] is None  # no graph on CPU


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU, run the script itself")
def test_gpu_check_localises_a_wrong_compiled_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled forward whose second layer's value projection is 50 % off: the steps section fails, teacher
    forcing shows the distance, the start-up check would have dropped it, and the localisation names layer 1."""
    from helpers.planted import scale_in_compiled_steps

    scale_in_compiled_steps(monkeypatch, 1, "v_proj", 1.5)
    gpu_check = load_gpu_check(monkeypatch)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--only", "steps", "--json", str(out)]) == 1
    compiled = json.loads(out.read_text())["steps"]["variants"]["compiled"]
    assert compiled["compiled"] and not compiled["fast_path_check"]["passed"]
    assert compiled["teacher_forced"]["max_abs_dlogp"] > 1e-3
    assert compiled["layers"]["first_layer_past_bound"] == 1
    assert max(compiled["layers"]["per_layer"][0].values()) < compiled["layers"]["bound"]


# Compiles every kernel to a cubin for sm_90, no GPU needed, to catch what only the compiler rejects
# (loop-carried types, dot shapes, layouts). It runs in a fresh process: triton.language's helpers are
# either interpreted or compiled per process, and this one interprets them.
COMPILE_FOR_HOPPER = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from paged_backend.kernels import triton_attention, triton_cache_write

def compile(kernel, signature, constexprs, num_warps=4):
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    positions = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=positions)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

attention = {
    "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
    "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
    "scale": "fp32", "softcap": "fp32", "sliding_window": "i32", "num_seqs": "i32", "block_size": "i32",
    "num_heads": "i32", "head_dim": "i32", "stride_q_t": "i32", "stride_q_h": "i32", "stride_o_t": "i32",
    "stride_o_h": "i32", "stride_c_h": "i64", "stride_c_slot": "i32", "stride_bt": "i32",
    "key_scale_ptr": "*fp32", "value_scale_ptr": "*fp32", "stride_s_h": "i32", "sinks_ptr": "*bf16",
    "chunk_size": "i32",
}
variants = [
    ("bf16", "bf16", dict(GROUP=4, GROUP_PAD=4, BLOCK_M=16, TILE_N=32, HEAD_PAD=64, NUM_SEGMENTS=4,
                          USE_SOFTCAP=False, USE_WINDOW=False, KV_INT8=False, USE_SINKS=True, USE_CHUNK=True), 4),
    ("fp16", "fp16", dict(GROUP=3, GROUP_PAD=4, BLOCK_M=64, TILE_N=64, HEAD_PAD=128, NUM_SEGMENTS=1,
                          USE_SOFTCAP=True, USE_WINDOW=True, KV_INT8=False, USE_SINKS=True, USE_CHUNK=False), 8),
    ("bf16", "i8", dict(GROUP=4, GROUP_PAD=4, BLOCK_M=16, TILE_N=32, HEAD_PAD=64, NUM_SEGMENTS=1,
                        USE_SOFTCAP=False, USE_WINDOW=False, KV_INT8=True, USE_SINKS=False, USE_CHUNK=True), 4),
]
for dtype, cache_dtype, constexprs, warps in variants:
    pointers = {name: "*" + dtype for name in ("out_ptr", "q_ptr")}
    pointers.update({name: "*" + cache_dtype for name in ("key_cache_ptr", "value_cache_ptr")})
    ptx = compile(triton_attention.paged_attention_kernel, {**pointers, **attention}, constexprs, warps).asm["ptx"]
    assert "mma" in ptx, "the dots do not run on tensor cores"
compile(triton_attention.merge_segments_kernel,
        {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
         "num_heads": "i32", "head_dim": "i32", "stride_o_t": "i32", "stride_o_h": "i32"},
        dict(NUM_SEGMENTS=4, HEAD_PAD=128))
strides = {"stride_%s_%s" % (t, d): "i32" for t in "kv" for d in "thd"}
for cache_dtype in ("bf16", "i8"):
    compile(triton_cache_write.write_kv_kernel,
            {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*" + cache_dtype,
             "value_cache_ptr": "*" + cache_dtype, "slot_ptr": "*i64", "key_scale_ptr": "*fp32",
             "value_scale_ptr": "*fp32", "num_kv_heads": "i32", "head_dim": "i32", **strides, "stride_c_h": "i64",
             "stride_c_slot": "i32", "stride_c_d": "i32", "stride_s_h": "i32"},
            dict(HEADS_PAD=8, HEAD_PAD=128, QUANTIZE=cache_dtype == "i8"))
print("compiled")
"""


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every test above compiles for real")
def test_kernels_compile_for_hopper() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated to silence its deprecation warning
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
