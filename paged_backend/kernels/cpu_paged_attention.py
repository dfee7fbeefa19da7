"""A compiled CPU kernel for the paged attention of every sequence with a few query rows, in one call.

Attended in PyTorch ops, a 32-sequence decode step pays per layer for gathers of every context out of the
paged cache, a cast of the gathered copy to fp32 and batched matmuls over it: three passes over the
context's bytes and a large share of the step (docs/benchmarks.md, benchmarks/step_profile.py). The kernel in
cpu_paged_attention.c reads each key and value row once, by block table, straight from the cache, widens it
to fp32 in registers and folds it into an online softmax, with the batch's (sequence, KV head) pairs shared
by torch's threads.

It serves sequences with up to MOST_ROWS query rows (decode rows, a request verifying proposed tokens, a
short chunk) and sequences of at most SHORT_SEQUENCE tokens whatever their rows (a chat's prompt), fp32 or
bf16 queries over an fp32, bf16 or int8 cache, with sliding windows, chunks, soft-capping, ALiBi and sinks.
Each chunk of keys is scored only against the rows at or past its position, so a short prompt's rows cost
the causal half of its square. Longer prompts stay on SDPA, whose blocked kernel is the faster one there
(`benchmarks/cpu_attention.py` times both on prompts of several lengths).

A bf16 model's decode rows over a bf16 cache, on a CPU with AVX512-BF16, take a path of their own: each key
row is multiplied by the query rows in bf16 pairs (`vdpbf16ps`, products exact, sums in fp32) straight from
the cache, 16 keys' partial sums are folded into one vector of 16 scores for the softmax, and the chunks two
ahead are fetched while one is worked on. It shortened a 32-sequence decode step against the generic path
(docs/benchmarks.md has the measurement).

With a float cache the call also stores the step's new key and value rows first (`stores()`), so a layer
makes one call where it made an `index_copy_` for K, one for V and the attention's: those copies were a
measurable part of a 32-sequence decode step (docs/benchmarks.md, benchmarks/step_profile.py).

The C source is compiled on the user's machine, once, and kept (cpu_build.py). Without a compiler, or
with `PAGED_BACKEND_CPU_KERNEL=0`, attention runs in PyTorch ops as before: slower, the same answers to
within fp32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_build
from .layer_attention import LayerAttention
from .layer_cache import PagedCaches
from .metadata import AttentionMetadata

ENV_SWITCH = cpu_build.ENV_SWITCH
SOURCE = Path(__file__).with_suffix(".c")
MOST_ROWS = 16  # a sequence with more query rows attends through SDPA, unless it is short:
SHORT_SEQUENCE = 128  # a sequence of at most this many tokens (context and new) attends here whatever its rows
EVERY_ROW = 2**31 - 1  # most_rows that takes every sequence (a batch-invariant step)
QUERY_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


class Arguments(ctypes.Structure):
    """The C kernel's `Arguments`, field for field."""
    _fields_ = [
        ("query", ctypes.c_void_p), ("query_dtype", ctypes.c_int),
        ("key_cache", ctypes.c_void_p), ("value_cache", ctypes.c_void_p), ("cache_dtype", ctypes.c_int),
        ("cache_head_stride", ctypes.c_int64),
        ("key_scales", ctypes.c_void_p), ("value_scales", ctypes.c_void_p), ("scale_head_stride", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int), ("block_size", ctypes.c_int),
        ("query_start", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("seqs", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
        ("scale", ctypes.c_float), ("window", ctypes.c_int), ("chunk", ctypes.c_int), ("softcap", ctypes.c_float),
        ("sinks", ctypes.c_void_p), ("alibi_slopes", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("threads", ctypes.c_int),
        ("new_key", ctypes.c_void_p), ("new_value", ctypes.c_void_p), ("key_token_stride", ctypes.c_int64),
        ("key_head_stride", ctypes.c_int64), ("value_token_stride", ctypes.c_int64),
        ("value_head_stride", ctypes.c_int64), ("slot_mapping", ctypes.c_void_p), ("num_tokens", ctypes.c_int),
    ]
SWITCH = cpu_build.Switch()  # switched_off(): attention in PyTorch ops inside the block (tests, benchmarks)
switched_off = SWITCH.switched_off


def serves(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel attends this layer's query over this cache (`[KVH, num_slots, D]`) here."""
    return (not SWITCH.off and query.device.type == "cpu" and query.dtype in QUERY_DTYPES
            and key_cache.dtype in CACHE_DTYPES and key_cache.stride(-1) == 1 and key_cache.stride(-2) == key_cache.shape[-1]
            and library() is not None)


def stores(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether the kernel's call stores this step's `key/value [T, KVH, D]` into the cache itself, at
    `slot_mapping`, before it reads (serves() said it attends over this cache): rows of the cache's own float
    dtype, each row contiguous."""
    return (key.dtype == key_cache.dtype and key_cache.dtype in (torch.float32, torch.bfloat16)
            and value.dtype == key.dtype and key.stride(-1) == 1 and value.stride(-1) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())


def kernel_sequences(metadata: AttentionMetadata, most_rows: int = MOST_ROWS) -> tuple[torch.Tensor, list[int]]:
    """The step's sequences the kernel attends (int32 indices), those of at most `most_rows` query rows or of at
    most SHORT_SEQUENCE tokens, and the others, memoised for every layer. A bf16 model's several rows over a long
    context keep SDPA in bf16, as HF's own attention does: the caller passes 1 for it. Over a short one the
    kernel's fp32 sums are the faster path (a prompt of 128 tokens: 1.3x SDPA's time, 32 tokens: 1.9x, on the
    AVX-512 EPYC; docs/benchmarks.md). A sequence whose image tokens attend both ways (`metadata.widened`) is
    never the kernel's: its causal rule is built in."""
    split = metadata.derived.get("cpu_kernel_sequences")
    if split is None:
        starts, lens, widened = metadata.query_start_loc_host, metadata.seq_lens_host, metadata.widened or {}
        takes = [(starts[i + 1] - starts[i] <= most_rows or lens[i] <= SHORT_SEQUENCE) and i not in widened
                 for i in range(metadata.num_seqs)]
        few = [i for i, take in enumerate(takes) if take]
        many = [i for i, take in enumerate(takes) if not take]
        split = metadata.derived["cpu_kernel_sequences"] = (torch.tensor(few, dtype=torch.int32), many)
    return split


def step_tensors(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block tables, query starts and lengths as the kernel reads them (contiguous int32), once a step."""
    tensors = metadata.derived.get("cpu_kernel_step")
    if tensors is None:
        tensors = metadata.derived["cpu_kernel_step"] = tuple(
            t.to(torch.int32).contiguous() for t in (metadata.block_tables, metadata.query_start_loc, metadata.seq_lens))
    return tensors


def attend(
    query: torch.Tensor,
    cache: PagedCaches,
    metadata: AttentionMetadata,
    seqs: torch.Tensor,
    out: torch.Tensor,
    layer: LayerAttention,
    new_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write into `out [T, H, D]` (contiguous, the query's dtype) the attention of the rows of sequences `seqs` of
    packed `query [T, H, D]` over the paged `cache` (K and V `[KVH, num_slots, D]`, int8: times their scales
    `[KVH, num_slots]`), with what `layer` asks for; first, with `new_rows`, store the step's new key and value rows
    `[T, KVH, D]` at the step's slot mapping (stores() said so). The caller checked serves()."""
    query = query.contiguous()
    tables, starts, lens = step_tensors(metadata)
    key_cache, value_cache, key_scales, value_scales = cache
    kv_heads, _, dim = key_cache.shape
    floats = [None if t is None else t.float().contiguous() for t in (layer.sinks, layer.alibi_slopes)]
    args = Arguments(
        query.data_ptr(), QUERY_DTYPES[query.dtype], key_cache.data_ptr(), value_cache.data_ptr(),
        CACHE_DTYPES[key_cache.dtype], key_cache.stride(0),
        key_scales.data_ptr() if key_scales is not None else None,
        value_scales.data_ptr() if value_scales is not None else None,
        key_scales.stride(0) if key_scales is not None else 0,
        tables.data_ptr(), tables.shape[1], metadata.block_size, starts.data_ptr(), lens.data_ptr(), seqs.data_ptr(),
        len(seqs), query.shape[1], kv_heads, dim, layer.scale, layer.window or 0, layer.chunk or 0, layer.softcap or 0.0,
        *(None if t is None else t.data_ptr() for t in floats), out.data_ptr(), torch.get_num_threads())
    if new_rows is not None:
        key, value = new_rows
        args.new_key, args.new_value = key.data_ptr(), value.data_ptr()
        args.key_token_stride, args.key_head_stride = key.stride(0), key.stride(1)
        args.value_token_stride, args.value_head_stride = value.stride(0), value.stride(1)
        args.slot_mapping, args.num_tokens = metadata.slot_mapping.data_ptr(), key.shape[0]
    library().paged_attention(ctypes.byref(args))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (cpu_build.py), or None (switched off, or no compiler: said once)."""
    return cpu_build.load(SOURCE, declare, "attention runs in PyTorch ops, slower")


def declare(lib: ctypes.CDLL) -> None:
    lib.paged_attention.argtypes = [ctypes.POINTER(Arguments)]
    lib.paged_attention.restype = None
