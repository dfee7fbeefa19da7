"""Attention's share of an engine step on this machine: the throughput workload (MT-bench first turns,
the default model, greedy) served by the engine, with the paged-attention and cache-write calls timed.

    python benchmarks/attention_share.py                   # 32 prompts, max_tokens 16..128
    python benchmarks/attention_share.py --num-prompts 8

Prints the share of step time spent in paged attention and in cache writes (each call timed with
perf_counter around it, so the share includes the calls' Python overhead) and writes them to
benchmarks/results/attention_share.json.
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
from throughput import SEED, serve_engine

from paged_backend import Engine, EngineConfig
from paged_backend.model import custom_ops
from paged_backend.model.model_loader import load_model


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
    parser.add_argument("--json", type=Path, default=None,
                        help="results file (default benchmarks/results/attention_share.json)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(None, dtype=torch.float32)
    workload = chat_workload(tokenizer, load_mt_bench_prompts(args.num_prompts),
                             draw_max_tokens(args.num_prompts, 16, 128, SEED))
    serve_engine(Engine(model, tokenizer, EngineConfig()), workload, time.time())  # warm-up run, untimed
    totals = {"attention": 0.0, "cache_write": 0.0}
    # The custom ops call these dispatchers (every architecture, adapters included, goes through the ops).
    custom_ops.dispatch_attention = timed(custom_ops.dispatch_attention, totals, "attention")
    custom_ops.dispatch_write = timed(custom_ops.dispatch_write, totals, "cache_write")
    engine = Engine(model, tokenizer, EngineConfig())
    start = time.perf_counter()
    serve_engine(engine, workload, time.time())
    wall = time.perf_counter() - start
    shares = {key: value / wall for key, value in totals.items()}
    print(f"engine run {wall:.1f} s, {torch.get_num_threads()} torch threads: "
          f"paged attention {100 * shares['attention']:.1f} %, cache writes {100 * shares['cache_write']:.1f} %")
    report = {"num_prompts": args.num_prompts, "wall_s": wall, "seconds": totals, "shares": shares,
              "machine": machine_info(),
              "command": " ".join(["python", "benchmarks/attention_share.py",
                                   *(sys.argv[1:] if argv is None else argv)])}
    print(f"results: {write_results(report, 'attention_share', args.json)}")
    return shares


if __name__ == "__main__":
    main()
