"""One stream of the default model with fused projections against the same engine without them, eager and compiled.

The default model is loaded once, at the engine's default precision (int4 on CPU). Over that one model object,
one engine per (mode, fusion): eager or compiled (`compile=False` / `True`), `fuse_projections=True` or
`False`. Each repeat runs one greedy MT-bench chat answer of `--tokens` tokens (end of sequence banned) on the
fused and the unfused engine of a mode back to back (which goes first alternates), so each ratio (fused over
unfused tokens/s) comes from one run on one machine state; the medians of the repeats are printed and
written, with whether both engines gave the same tokens.

    python benchmarks/fused_projections.py                    # eager and compiled, 3 repeats of 64 tokens
    python benchmarks/fused_projections.py --modes eager --repeats 5

The compiled engines compile the forward (or load it from the compile cache): a cold compile of the default
model takes about a minute on two cores, once per fusion setting.
Writes benchmarks/results/fused_projections_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_mt_bench_prompts, write_results

MODES = {"eager": False, "compiled": True}
KV_BYTES = 64 * 2**20  # four engines over one model: each needs a few hundred tokens of cache, not the default


def one_stream(engine: Any, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """Tokens/s of one greedy answer of `tokens` tokens through `engine`, and the tokens."""
    from paged_backend import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    request_id = engine.add_request(prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    seconds = time.perf_counter() - start
    token_ids = final.outputs[0].token_ids
    return len(token_ids) / seconds, list(token_ids)


def build_engines(modes: Sequence[str]) -> tuple[Any, dict[tuple[str, bool], Any], dict[str, float]]:
    """The default model's LLM (fused, eager) and an engine per (mode, fusion) over its model; start-up seconds."""
    from paged_backend import LLM, Engine, EngineConfig

    start = time.perf_counter()
    llm = LLM(compile=False, fuse_projections=True, kv_cache_bytes=KV_BYTES)
    seconds = {"load": time.perf_counter() - start}
    engines = {}
    for mode in modes:
        for fused in (True, False):
            if (mode, fused) == ("eager", True):
                engines[mode, fused] = llm.engine
                continue
            start = time.perf_counter()
            config = EngineConfig(compile=MODES[mode], fuse_projections=fused, kv_cache_bytes=KV_BYTES)
            engines[mode, fused] = Engine(llm.model, llm.tokenizer, config)
            seconds[f"{mode}_{'fused' if fused else 'unfused'}_engine"] = time.perf_counter() - start
    return llm, engines, seconds


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="answer length of each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default: benchmarks/results/fused_projections_<machine class>.json)")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {sorted(MODES)}")
    import torch

    from paged_backend.model.quantized.int4_linear import has_int4_layers

    if args.threads:
        torch.set_num_threads(args.threads)
    llm, engines, startup = build_engines(modes)
    prompt_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": load_mt_bench_prompts(1)[0]}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    for engine in engines.values():
        one_stream(engine, prompt_ids, 8)  # warm up: first-call allocations
    runs: dict[str, dict[str, list]] = {m: {"fused": [], "unfused": [], "ratio": []} for m in modes}
    same_tokens = {m: True for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            # Alternate which goes first, so a load that drifts during a repeat favours neither.
            order = (True, False) if repeat % 2 == 0 else (False, True)
            measured = {fused: one_stream(engines[mode, fused], prompt_ids, args.tokens) for fused in order}
            (fused, fused_ids), (unfused, unfused_ids) = measured[True], measured[False]
            runs[mode]["fused"].append(fused)
            runs[mode]["unfused"].append(unfused)
            runs[mode]["ratio"].append(fused / unfused)
            same_tokens[mode] &= fused_ids == unfused_ids
    medians = {mode: {name: statistics.median(values) for name, values in by.items()} for mode, by in runs.items()}
    result = {"model": "default", "dtype": str(llm.model.dtype), "int4_weights": has_int4_layers(llm.model),
              "threads": torch.get_num_threads(), "tokens": args.tokens, "repeats": args.repeats,
              "startup_s": startup, "runs": runs, "medians": medians, "same_tokens": same_tokens}
    path = write_results(result, "fused_projections", args.json)
    for mode, values in medians.items():
        print(f"{mode:<9} fused {values['fused']:6.1f} tok/s  unfused {values['unfused']:6.1f} tok/s  "
              f"ratio {values['ratio']:.2f}x (runs {[round(r, 2) for r in runs[mode]['ratio']]})  "
              f"same tokens: {same_tokens[mode]}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
