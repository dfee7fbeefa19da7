"""Prefix caching on against off: many requests sharing a long system prompt, in one run.

Workload: N requests (default 64) whose chat prompts share a system message of about 512 tokens
(built from MT-bench text) and end in different MT-bench questions; greedy, EOS ignored, a fixed
number of output tokens. After an untimed warm-up of both settings, the settings take turns
(`--repeats` runs each) and each reports its median run. Prints throughput, wall time, prefill
tokens computed and the hit rate for each setting, then the ratio, checks every run produced the
same tokens, and writes benchmarks/results/prefix_cache_<machine class>.json and a chart beside it.

    python benchmarks/prefix_cache.py [--num-requests 64] [--max-tokens 16] [--system-tokens 512] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charts
from common import load_mt_bench_prompts, machine_info, write_results

from paged_backend import LLM, SamplingParams
from paged_backend.engine import Engine


def build_prompts(llm: LLM, num_requests: int, system_tokens: int) -> list[list[int]]:
    tok = llm.tokenizer
    corpus = " ".join(load_mt_bench_prompts(80, turn=1))
    system = tok.decode(tok(corpus)["input_ids"][:system_tokens])
    questions = load_mt_bench_prompts(num_requests)
    return [llm.render_chat([{"role": "system", "content": system}, {"role": "user", "content": q}],
                            add_generation_prompt=True, tools=None, extra={}) for q in questions]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, caching: bool) -> dict:
    engine = Engine(llm.model, llm.tokenizer, llm.engine.config.__class__(enable_prefix_caching=caching,
                                                                           num_kv_blocks=llm.engine.kv.pool.num_blocks))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    wall = time.perf_counter() - start
    outputs = [finals[i].outputs[0].token_ids for i in ids]
    stats = engine.stats()
    generated = sum(len(o) for o in outputs)
    return {
        "prefix_caching": caching,
        "wall_s": wall,
        "output_tokens_per_s": generated / wall,
        "requests_per_s": len(prompts) / wall,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_tokens_computed": stats["num_computed_tokens"] - (generated - len(prompts)),
        "cached_prompt_tokens": sum(finals[i].num_cached_tokens for i in ids),
        "hit_rate": stats["prefix_cache_hit_rate"],
        "tokens": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each setting; medians count")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(None, num_kv_blocks=args.num_kv_blocks)
    prompts = build_prompts(llm, args.num_requests, args.system_tokens)
    for caching in (False, True):  # warm-up, untimed: first-call costs land on neither setting
        run(llm, prompts[:2], 2, caching)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for repeat in range(args.repeats):  # off, on, then on, off, ...: a burst of load hits both settings
        for caching in ((False, True) if repeat % 2 == 0 else (True, False)):
            runs[caching].append(run(llm, prompts, args.max_tokens, caching))
    off, on = median_run(runs[False]), median_run(runs[True])
    print(f"{args.num_requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} output tokens each, {args.repeats} alternating runs of each setting (medians)")
    print(f"{'prefix caching':>15} {'wall s':>8} {'out tok/s':>10} {'req/s':>7} {'prefill computed':>17} {'hit rate':>9}")
    for r in (off, on):
        print(f"{'on' if r['prefix_caching'] else 'off':>15} {r['wall_s']:8.1f} {r['output_tokens_per_s']:10.1f} "
              f"{r['requests_per_s']:7.2f} {r['prefill_tokens_computed']:17d} {r['hit_rate']:9.2f}")
    ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    reference = runs[False][0]["tokens"]
    same = all(r["tokens"] == reference for r in runs[False] + runs[True])
    print(f"throughput ratio on/off: {ratio:.2f}x (target >= 3x); prefill tokens "
          f"{off['prefill_tokens_computed']} -> {on['prefill_tokens_computed']}; same tokens in every run: {same}")
    for r in runs[False] + runs[True]:
        r.pop("tokens")
    report = {"machine": machine_info(), "args": vars(args) | {"json": None}, "off": off, "on": on,
              "ratio": ratio, "same_tokens": same,
              "command": " ".join(["python", "benchmarks/prefix_cache.py", *sys.argv[1:]])}
    path = write_results(report, "prefix_cache", args.json)
    print(f"results: {path}; chart: {charts.draw('prefix_cache', report, path)}")


def median_run(runs: list[dict]) -> dict:
    """The setting's run of median wall time, with every run's wall time beside it."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["wall_s_runs"] = [r["wall_s"] for r in runs]
    return middle


if __name__ == "__main__":
    main()
