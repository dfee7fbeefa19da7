"""The compiled CPU paged-attention kernel against the PyTorch ops it replaces, on one layer's call and on the engine.

1. One layer's call: `--seqs` decode rows (SmolLM2-135M shapes: 9 query heads, 3 KV heads, head size 64) over
   contexts of 250-700 keys in shuffled 16-slot blocks of a bf16 cache, the kernel and the PyTorch ops
   (gathers, fp32 casts, batched matmuls in length buckets) alternating, medians of `--repeats` rounds.
2. Prompts: one layer's call for 4 fresh bf16 prompts of 32, 64 and 128 tokens (a chat's prompts, within
   `cpu_paged_attention.SHORT_SEQUENCE`), the kernel against SDPA (the rule switched off), alternating.
3. The engine: the throughput workload (benchmarks/throughput.py: 32 MT-bench prompts, 16..128 greedy
   tokens each) at the defaults (compiled, int4, bf16), the kernel switched on and off in one process
   (`cpu_paged_attention.switched_off()`, no recompile: the attention is an opaque op of the graph),
   alternating, medians; and how many of the 32 answers came out token for token the same both ways (bf16
   rounds the two attention paths' fp32 sums differently, so near-ties can part). The same workload with
   the short-sequence rule on and off (its prompts prefilled by the kernel or by SDPA).

    python benchmarks/cpu_attention.py                  # 5 rounds each
    python benchmarks/cpu_attention.py --repeats 3 --skip-engine

Writes benchmarks/results/cpu_attention_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` and `throughput` sit beside this script

from common import alternate, load_average, workload_runs, write_results

from paged_backend.kernels import AttentionMetadata, LayerAttention, PagedCaches, cpu_paged_attention, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
PATHS = ("kernel", "torch_ops")


def path_context(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if name == "kernel" else cpu_paged_attention.switched_off()


def one_layer_call(seqs: int, repeats: int) -> dict[str, Any]:
    """Microseconds per call of one layer's attention for `seqs` decode rows, both ways."""
    rng = np.random.default_rng(0)
    lens = rng.integers(250, 700, seqs).tolist()
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    order = rng.permutation(sum(blocks))
    tables = np.zeros((seqs, max(blocks)), np.int32)
    offset = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[offset:offset + count]
        offset += count
    cache = torch.randn(2, KV_HEADS, sum(blocks) * BLOCK_SIZE, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    cache = cache.to(torch.bfloat16)
    query = torch.randn(seqs, HEADS, HEAD_DIM).to(torch.bfloat16)
    starts = list(range(seqs + 1))
    caches, layer = PagedCaches(cache[0], cache[1]), LayerAttention(HEAD_DIM ** -0.5)
    metadata = AttentionMetadata(torch.full((seqs,), -1), torch.from_numpy(tables), torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), BLOCK_SIZE, starts, lens, 1, max(lens))

    def attend() -> torch.Tensor:
        return paged_attention(query, caches, metadata, layer)

    with path_context("torch_ops"):
        want = paged_attention(query, caches, metadata, layer)
    got = paged_attention(query, caches, dataclasses.replace(metadata, derived={}), layer)
    figures = alternate({name: timed_calls(attend, functools.partial(path_context, name), metadata) for name in PATHS},
                        repeats)
    medians = {name: statistics.median(v) for name, v in figures.items()}
    return {"seqs": seqs, "keys": sum(lens), "max_abs_difference": float((got.float() - want.float()).abs().max()),
            "us_per_call": figures, "median_us": medians, "speedup": medians["torch_ops"] / medians["kernel"]}


def timed_calls(attend: Callable[[], object], context: Callable[[], contextlib.AbstractContextManager],
                metadata: AttentionMetadata) -> Callable[[], float]:
    """A run for `alternate`: the median microseconds of 30 calls of `attend` inside `context()`, after one untimed
    call. The step's memo is cleared first: a step's plans are built once and serve its 30 layers, timed apart."""
    def run() -> float:
        metadata.derived.clear()
        with context():
            attend()
            times = []
            for _ in range(30):
                start = time.perf_counter()
                attend()
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    return run


PROMPT_LENGTHS = (32, 64, 128)


@contextlib.contextmanager
def prompts_on_sdpa():
    """Inside the block, only sequences of a few rows attend in the kernel: prompts go to SDPA, as before the
    short-sequence rule."""
    short, cpu_paged_attention.SHORT_SEQUENCE = cpu_paged_attention.SHORT_SEQUENCE, 0
    try:
        yield
    finally:
        cpu_paged_attention.SHORT_SEQUENCE = short


def prompt_call(length: int, repeats: int, count: int = 4) -> dict[str, Any]:
    """Microseconds per call of one layer's attention over `count` fresh bf16 prompts of `length` tokens (their keys
    already in the cache), the kernel against SDPA."""
    blocks = -(-length // BLOCK_SIZE)
    tables = np.arange(count * blocks, dtype=np.int32).reshape(count, blocks)
    cache = torch.randn(2, KV_HEADS, count * blocks * BLOCK_SIZE, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    cache = cache.to(torch.bfloat16)
    query = torch.randn(count * length, HEADS, HEAD_DIM).to(torch.bfloat16)
    starts, lens = list(range(0, count * length + 1, length)), [length] * count
    caches, layer = PagedCaches(cache[0], cache[1]), LayerAttention(HEAD_DIM ** -0.5)
    metadata = AttentionMetadata(torch.full((count * length,), -1), torch.from_numpy(tables),
                                 torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                 BLOCK_SIZE, starts, lens, length, length)
    paths = {"kernel": contextlib.nullcontext, "sdpa": prompts_on_sdpa}

    def attend() -> torch.Tensor:
        return paged_attention(query, caches, metadata, layer)

    outputs = {}
    for name, path in paths.items():
        with path():
            outputs[name] = paged_attention(query, caches, dataclasses.replace(metadata, derived={}), layer)
    figures = alternate({name: timed_calls(attend, path, metadata) for name, path in paths.items()}, repeats)
    medians = {name: statistics.median(v) for name, v in figures.items()}
    return {"prompts": count, "length": length, "us_per_call": figures, "median_us": medians,
            "speedup": medians["sdpa"] / medians["kernel"],
            "max_abs_difference": float((outputs["kernel"].float() - outputs["sdpa"].float()).abs().max())}


def engine_throughput(repeats: int) -> dict[str, Any]:
    """Tokens/s of the throughput workload at the defaults, both ways, in one process."""
    runs, answers, prompts = workload_runs({name: functools.partial(path_context, name) for name in PATHS})
    figures = alternate(runs, repeats)
    same = sum(a == b for a, b in zip(answers["kernel"], answers["torch_ops"]))
    medians = {name: statistics.median(v) for name, v in figures.items()}
    return {"prompts": prompts, "tokens_per_s": figures, "median_tokens_per_s": medians,
            "speedup": medians["kernel"] / medians["torch_ops"], "identical_answers": same}


def engine_prompts(repeats: int) -> dict[str, Any]:
    """Tokens/s of the throughput workload at the defaults, its prompts attended by the kernel and by SDPA, in
    one process."""
    runs, answers, prompts = workload_runs({"kernel": contextlib.nullcontext, "sdpa": prompts_on_sdpa})
    figures = alternate(runs, repeats)
    medians = {name: statistics.median(v) for name, v in figures.items()}
    return {"prompts": prompts, "tokens_per_s": figures, "median_tokens_per_s": medians,
            "speedup": medians["kernel"] / medians["sdpa"],
            "identical_answers": sum(a == b for a, b in zip(answers["kernel"], answers["sdpa"]))}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seqs", type=int, default=32, help="decode rows of the one-layer call")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if cpu_paged_attention.library() is None:
        raise SystemExit("the CPU kernel is not built here (no C compiler, or PAGED_BACKEND_CPU_KERNEL=0)")
    load_start = load_average()
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": args.repeats,
                               "one_layer_call": one_layer_call(args.seqs, args.repeats)}
    call = results["one_layer_call"]["median_us"]
    print(f"one layer, {args.seqs} decode rows: kernel {call['kernel']:.0f} us, torch ops {call['torch_ops']:.0f} us "
          f"= {call['torch_ops'] / call['kernel']:.2f}x")
    results["prompt_calls"] = [prompt_call(length, args.repeats) for length in PROMPT_LENGTHS]
    for call in results["prompt_calls"]:
        us = call["median_us"]
        print(f"one layer, {call['prompts']} prompts of {call['length']}: kernel {us['kernel']:.0f} us, "
              f"SDPA {us['sdpa']:.0f} us = {call['speedup']:.2f}x")
    if not args.skip_engine:
        engine = results["engine"] = engine_throughput(args.repeats)
        rate = engine["median_tokens_per_s"]
        print(f"throughput workload: kernel {rate['kernel']:.1f} tok/s, torch ops {rate['torch_ops']:.1f} tok/s "
              f"= {rate['kernel'] / rate['torch_ops']:.2f}x; identical answers {engine['identical_answers']} of "
              f"{engine['prompts']}")
        engine = results["engine_prompts"] = engine_prompts(args.repeats)
        rate = engine["median_tokens_per_s"]
        print(f"throughput workload, prompts by the kernel {rate['kernel']:.1f} tok/s, by SDPA {rate['sdpa']:.1f} "
              f"tok/s = {engine['speedup']:.2f}x")
    results["load_1m_start"], results["load_1m_end"] = load_start, load_average()
    print(f"threads {results['threads']}; load average {load_start:.1f} -> {results['load_1m_end']:.1f}; "
          f"wrote {write_results(results, 'cpu_attention', args.json)}")
    return results


if __name__ == "__main__":
    main()
