"""What thread-safe stats cost: `AsyncEngine.stats()` answered by the engine thread between steps.

A random 2-layer Llama (hidden 64, vocabulary 256) serves batches of requests; `stats()` is timed
idle and while a batch runs, and batches run alternately without and with a scraper thread calling
`stats()` in a loop (far more often than any Prometheus scrape), each setting reporting its median
tokens/s. Prints both and writes benchmarks/results/stats_scrape_<machine class>.json.

    python benchmarks/stats_scrape.py [--requests 32] [--max-tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, median, write_results

from paged_backend import AsyncEngine, Engine, EngineConfig, SamplingParams


def tiny_llama() -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return tf.LlamaForCausalLM(config).eval()


def run_batch(aengine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens/s of one batch submitted at once."""
    left = [len(prompts)]
    lock, done = threading.Lock(), threading.Event()

    def sink(output) -> None:
        if output.finished:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

    start = time.perf_counter()
    for prompt in prompts:
        aengine.submit(prompt, params, None, sink)
    done.wait()
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def scraped_batch(aengine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                  latencies: list[float]) -> float:
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            aengine.stats()
            latencies.append(time.perf_counter() - start)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        return run_batch(aengine, prompts, params)
    finally:
        stop.set()
        scraper.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    aengine = AsyncEngine(Engine(tiny_llama(), None, EngineConfig(num_kv_blocks=512, max_num_seqs=args.requests)))
    prompts = [[(7 * i + j) % 250 + 3 for j in range(16)] for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    idle = []
    for _ in range(50):
        start = time.perf_counter()
        aengine.stats()
        idle.append(time.perf_counter() - start)
    run_batch(aengine, prompts, params)  # warm-up
    plain, scraped, busy = [], [], []
    for _ in range(args.repeats):
        plain.append(run_batch(aengine, prompts, params))
        scraped.append(scraped_batch(aengine, prompts, params, busy))
    aengine.shutdown()
    result = {"stats_idle_ms": median(idle) * 1e3, "stats_busy_ms": median(busy) * 1e3, "stats_busy_calls": len(busy),
              "tokens_per_s_plain": median(plain), "tokens_per_s_scraped": median(scraped),
              "ratio": median(scraped) / median(plain), "args": vars(args), "machine": machine_info()}
    print(f"stats() idle {result['stats_idle_ms']:.2f} ms, while a batch runs {result['stats_busy_ms']:.2f} ms "
          f"(median of {len(busy)} calls)")
    print(f"tokens/s without a scraper {result['tokens_per_s_plain']:.0f}, with one calling stats() in a loop "
          f"{result['tokens_per_s_scraped']:.0f} (ratio {result['ratio']:.2f}; medians of {args.repeats} "
          f"alternated runs; load {result['machine']['load_average_1m']:.1f})")
    print(f"wrote {write_results(result, 'stats_scrape')}")


if __name__ == "__main__":
    main()
