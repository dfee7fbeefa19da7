"""Attention's share of an engine step on this machine: the throughput workload (MT-bench first turns,
the default model, greedy) served by the CPU engine, with its cache writes, context reads and attention timed.

    python benchmarks/attention_share.py                   # 32 prompts, max_tokens 16..128, fp32
    python benchmarks/attention_share.py --precision default --num-prompts 8

Prints the share of the run's wall time spent in the PyTorch backend's cache writes, in its reads of the
sequences' contexts out of the paged cache (gathers and casts), and in the rest of paged attention (each call
timed with perf_counter around it, so a share includes the calls' Python overhead), and writes them to
benchmarks/results/attention_share_<machine class>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` and `throughput` sit beside this script

from common import (
    chat_workload,
    draw_max_tokens,
    load_mt_bench_prompts,
    machine_info,
    write_results,
)
from paged_backend.kernels import torch_attention
from throughput import SEED, serve_engine

from paged_backend import LLM


def timed(fn: Callable, totals: dict[str, float], key: str) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--precision", choices=("fp32", "default"), default="fp32",
                        help="the model's precision: fp32, or the engine's default on this CPU (int4 codes)")
    parser.add_argument("--json", type=Path, default=None,
                        help="results file (default benchmarks/results/attention_share_<machine class>.json)")
    args = parser.parse_args(argv)
    llm = LLM(None, **({"dtype": torch.float32} if args.precision == "fp32" else {}))
    workload = chat_workload(llm.tokenizer, load_mt_bench_prompts(args.num_prompts),
                             draw_max_tokens(args.num_prompts, 16, 128, SEED))
    serve_engine(llm.engine, workload, time.time())  # warm-up run, untimed
    totals = {"cache_write": 0.0, "context_read": 0.0, "attention": 0.0}
    # The backend looks these up as module globals at each call, so wrapping them times every layer's calls.
    torch_attention.write_rows = timed(torch_attention.write_rows, totals, "cache_write")
    torch_attention.read_context = timed(torch_attention.read_context, totals, "context_read")
    torch_attention.attend_sequences = timed(torch_attention.attend_sequences, totals, "attention")
    start = time.perf_counter()
    serve_engine(llm.engine, workload, time.time())
    wall = time.perf_counter() - start
    totals["attention"] -= totals["context_read"]  # reads happen inside attend_sequences
    shares = {key: value / wall for key, value in totals.items()}
    print(f"engine run {wall:.1f} s ({args.precision}), {torch.get_num_threads()} torch threads: "
          f"cache writes {100 * shares['cache_write']:.1f} %, context reads {100 * shares['context_read']:.1f} %, "
          f"rest of attention {100 * shares['attention']:.1f} %")
    report = {"num_prompts": args.num_prompts, "precision": args.precision, "wall_s": wall, "seconds": totals,
              "shares": shares, "machine": machine_info(),
              "command": " ".join(["python", "benchmarks/attention_share.py",
                                   *(sys.argv[1:] if argv is None else argv)])}
    print(f"results: {write_results(report, 'attention_share', args.json)}")
    return shares


if __name__ == "__main__":
    main()
