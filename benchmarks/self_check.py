"""What the engine's start-up checks cost on the default model, each timed alone (median of several runs): the
load-time self-check (three small forwards, in --dtype) beside one plain 8-token forward and the engine's start
without it; and the compiled forward's check against the eager one (fast_path_check.py) at the defaults (bf16 where
the CPU has it, int4, compiled) beside a warm start of the default engine without it (a new process, imports
included, its graphs from the compile cache), as a share of that start."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import uptime, write_results

from paged_backend import LLM, Engine, EngineConfig
from paged_backend.model.compiled import fast_path_check
from paged_backend.model.loading import model_check
from paged_backend.model.loading.model_loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", type=Path, default=None, help="results file (default: benchmarks/results/self_check_<machine class>.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(None, dtype=args.dtype, device="cpu")
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, self_check=False))
    checks, starts, bare = [], [], []
    ids = torch.arange(8)[None]
    for _ in range(args.repeats):
        began = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids)  # one plain 8-token forward: the unit the check's cost is made of
        bare.append(time.perf_counter() - began)
        model_check._checked.pop(model, None)  # the check runs once per model object; force it again
        began = time.perf_counter()
        model_check.check_paged_matches_dense(model, engine.cache.shape)
        checks.append(time.perf_counter() - began)
        began = time.perf_counter()
        Engine(model, None, EngineConfig(num_kv_blocks=64, self_check=False))
        starts.append(time.perf_counter() - began)
    fast = fast_path_costs(args.repeats)
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "threads": torch.get_num_threads(),
        **fast,
        "self_check_ms": [round(c * 1e3, 1) for c in checks],
        "self_check_median_ms": round(statistics.median(checks) * 1e3, 1),
        "plain_8_token_forward_median_ms": round(statistics.median(bare) * 1e3, 1),
        "engine_start_without_check_median_ms": round(statistics.median(starts) * 1e3, 1),
        "uptime": uptime(),
    }
    print(f"self-check median {result['self_check_median_ms']:.0f} ms (runs: {result['self_check_ms']}); one plain "
          f"8-token forward {result['plain_8_token_forward_median_ms']:.0f} ms; engine start without the check "
          f"{result['engine_start_without_check_median_ms']:.0f} ms; {result['uptime']}")
    print(f"compiled-forward check median {fast['fast_path_check_median_ms']:.0f} ms (runs: "
          f"{fast['fast_path_check_ms']}); warm default start without it {fast['warm_start_median_ms']:.0f} ms: "
          f"the check is {fast['fast_path_check_share_of_warm_start']:.1%} of a warm start")
    print(f"wrote {write_results(result, 'self_check', args.json)}")


def fast_path_costs(repeats: int) -> dict:
    """The compiled forward's start-up check at the defaults, and the warm start it adds to: a new process that
    imports the package and builds LLM() with the check off, its graphs loaded from the compile cache."""
    llm = LLM(self_check=False)  # compiles, or loads, the default graphs once: every start below is warm
    checks, starts = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        check = fast_path_check.check_compiled(llm.engine.runner)
        checks.append(time.perf_counter() - began)
        assert check.passed, check
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "from paged_backend import LLM; LLM(self_check=False)"], check=True,
                       capture_output=True)
        starts.append(time.perf_counter() - began)
    return {"fast_path_check_ms": [round(c * 1e3, 1) for c in checks],
            "fast_path_check_median_ms": round(statistics.median(checks) * 1e3, 1),
            "fast_path_check_max_kl": check.worst, "fast_path_check_kl_bound": check.allowed,
            "warm_start_median_ms": round(statistics.median(starts) * 1e3, 1),
            "fast_path_check_share_of_warm_start": round(statistics.median(checks) / statistics.median(starts), 4)}


if __name__ == "__main__":
    main()
