"""The compiled CPU int8 matmul against torch's `_weight_int8pack_mm` on the default model's LM head, and on one stream.

1. One call of the head (49,152 x 576 int8 codes, one bf16 row), the kernel and torch's alternating, medians of
   `--repeats` rounds of 50 calls; before each call a 64 MB buffer is read, so the head's 28 MB come from
   memory as in a decode step (where the layers' weights pass through the caches in between).
2. One stream at the defaults (compiled, int4, bf16): one MT-bench prompt, `--tokens` greedy tokens (end of
   sequence ignored), the kernel switched on and off in one process (`cpu_int8_matmul.switched_off()`, no
   recompile: the head is an opaque op of the graph), alternating, medians; whether the tokens agree.

    python benchmarks/cpu_int8_head.py                  # 5 rounds each
    python benchmarks/cpu_int8_head.py --repeats 3 --tokens 64

Writes benchmarks/results/cpu_int8_head_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

from common import alternate, load_average, load_mt_bench_prompts, write_results

from paged_backend.kernels import cpu_int8_matmul

PATHS = ("kernel", "torch")
VOCAB, HIDDEN = 49152, 576
CALLS = 50


def path_context(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if name == "kernel" else cpu_int8_matmul.switched_off()


def one_call(repeats: int) -> dict[str, Any]:
    """Microseconds per call of the head at one row, both ways, its codes read from memory."""
    from paged_backend.model.quantized.int8_linear import int8_matmul

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=g, dtype=torch.int8)
    scales = (torch.rand(VOCAB, generator=g) * 0.01).bfloat16()
    dense = torch.empty(0, HIDDEN, dtype=torch.bfloat16)  # unread at one row
    row = torch.randn(1, HIDDEN, generator=g).bfloat16()
    evict = torch.ones(16 * 1024 * 1024)  # 64 MB, more than the last-level cache

    def timed(name: str) -> Callable[[], float]:
        def run() -> float:
            total = 0.0
            with path_context(name):
                for _ in range(CALLS):
                    evict.sum()
                    start = time.perf_counter()
                    int8_matmul(row, codes, scales, dense, None)
                    total += time.perf_counter() - start
            return total / CALLS * 1e6
        return run

    figures = alternate({name: timed(name) for name in PATHS}, repeats)
    return {"median_us": {name: statistics.median(v) for name, v in figures.items()}, "us": figures}


def one_stream(repeats: int, tokens: int) -> dict[str, Any]:
    """Tokens/s of one greedy stream at the defaults, both ways, in one process."""
    from paged_backend import LLM, SamplingParams

    llm = LLM(None)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": load_mt_bench_prompts(1)[0]}],
                                               add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    answers: dict[str, list[int]] = {}

    def timed(name: str) -> Callable[[], float]:
        def run() -> float:
            with path_context(name):
                llm.reset_prefix_cache()
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                elapsed = time.perf_counter() - start
            answers[name] = list(out.outputs[0].token_ids)
            return len(answers[name]) / elapsed
        return run

    timed("kernel")()  # warm-up: graphs loaded, kernels built
    figures = alternate({name: timed(name) for name in PATHS}, repeats)
    same = next((i for i, (a, b) in enumerate(zip(answers["kernel"], answers["torch"])) if a != b), None)
    return {"tokens": tokens, "tokens_per_s": figures,
            "median_tokens_per_s": {name: statistics.median(v) for name, v in figures.items()},
            "first_difference": same}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if cpu_int8_matmul.library() is None:
        raise SystemExit("the CPU kernel is not built here (no C compiler, or PAGED_BACKEND_CPU_KERNEL=0)")
    load_start = load_average()
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": args.repeats,
                               "one_call": one_call(args.repeats)}
    call = results["one_call"]["median_us"]
    print(f"the head at one row: kernel {call['kernel']:.0f} us, torch {call['torch']:.0f} us "
          f"= {call['torch'] / call['kernel']:.2f}x")
    stream = results["one_stream"] = one_stream(args.repeats, args.tokens)
    rate = stream["median_tokens_per_s"]
    print(f"one stream, {args.tokens} tokens: kernel {rate['kernel']:.1f} tok/s, torch {rate['torch']:.1f} tok/s = "
          f"{rate['kernel'] / rate['torch']:.2f}x; tokens differ from position {stream['first_difference']}")
    results["load_1m_start"], results["load_1m_end"] = load_start, load_average()
    print(f"threads {results['threads']}; load average {load_start:.1f} -> {results['load_1m_end']:.1f}; "
          f"wrote {write_results(results, 'cpu_int8_head', args.json)}")
    return results


if __name__ == "__main__":
    main()
