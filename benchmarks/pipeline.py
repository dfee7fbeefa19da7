"""Text-generation pipeline throughput: PagedTextGenerationPipeline against the stock pipeline (batch_size=8).

Same workload as the engine benchmark: MT-bench first turns as one-turn chats on the default model, greedy,
EOS ignored. A pipeline call takes one max_new_tokens for all inputs, so every request generates exactly
`--max-new-tokens` tokens. Both pipelines run in this process, alternating (`--repeats` times, the fastest
run of each counts), each on its own copy of the model; their outputs must be identical. Prints output
tokens/s of each and the ratio.

    python benchmarks/pipeline.py                     # 32 prompts x 48 new tokens
    python benchmarks/pipeline.py --num-prompts 32 --max-new-tokens 64 --json /tmp/pipeline.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

import charts
from common import load_mt_bench_prompts, machine_info, write_results
from paged_backend.integrations.pipeline import PagedTextGenerationPipeline

from paged_backend.model.loading.model_loader import load_model

STOCK_BATCH_SIZE = 8
TARGET_RATIO = 2.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    # One intra-op thread: on a shared 2-core machine two threads degrade many-fold when the cores are busy.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both pipelines")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the fastest counts")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    return parser.parse_args()


def build_pipelines() -> tuple[Any, Any]:
    stock_model, tokenizer = load_model(None)
    paged_model, _ = load_model(None)
    stock = transformers.pipeline("text-generation", model=stock_model, tokenizer=tokenizer)
    paged = transformers.pipeline("text-generation", model=paged_model, tokenizer=tokenizer,
                                  pipeline_class=PagedTextGenerationPipeline)
    return stock, paged


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stock, paged = build_pipelines()
    chats = [[{"role": "user", "content": q}] for q in load_mt_bench_prompts(args.num_prompts)]
    # eos_token_id=None: no request stops early, so both generate exactly the same number of tokens.
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "eos_token_id": None,
               "return_full_text": False}
    paged(chats[:1], max_new_tokens=2, do_sample=False)  # builds the engine: a one-off cost, not throughput
    stock(chats[:1], max_new_tokens=2, do_sample=False)  # the same untimed warm-up for the stock pipeline
    paged_times, stock_times = [], []
    for _ in range(args.repeats):  # alternating, so a burst of load on the shared cores hits both
        paged_out, seconds = timed(lambda: paged(chats, **options))
        paged_times.append(seconds)
        stock_out, seconds = timed(lambda: stock(chats, batch_size=STOCK_BATCH_SIZE, **options))
        stock_times.append(seconds)
    paged_s, stock_s = min(paged_times), min(stock_times)
    tokens = args.num_prompts * args.max_new_tokens
    same = sum(a == b for a, b in zip(paged_out, stock_out))
    report = {
        "workload": {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "greedy": True,
                     "eos_ignored": True, "stock_batch_size": STOCK_BATCH_SIZE},
        "stock": {"seconds": stock_s, "all_seconds": stock_times, "output_tokens_per_s": tokens / stock_s},
        "paged": {"seconds": paged_s, "all_seconds": paged_times, "output_tokens_per_s": tokens / paged_s},
        "throughput_ratio": stock_s / paged_s,
        "run_ratios": [s / p for s, p in zip(stock_times, paged_times)],  # each alternating round alone
        "identical_outputs": f"{same}/{args.num_prompts}",
        "machine": machine_info(),
    }
    print(f"stock pipeline (batch_size={STOCK_BATCH_SIZE}): {tokens / stock_s:7.1f} output tokens/s ({stock_s:.1f} s)")
    print(f"paged pipeline:                    {tokens / paged_s:7.1f} output tokens/s ({paged_s:.1f} s)")
    print(f"identical outputs: {same}/{args.num_prompts}")
    print(f"throughput ratio paged/stock: {report['throughput_ratio']:.2f}x (target >= {TARGET_RATIO:.0f}x)")
    path = write_results(report, "pipeline", args.json)
    print(f"results: {path}; chart: {charts.draw('pipeline', report, path)}")


if __name__ == "__main__":
    main()
