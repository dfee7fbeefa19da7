"""Prefix caching on against off: many requests sharing a long system prompt, in one run.

Workload: N requests (default 64) whose chat prompts share a system message of about 512 tokens
(built from MT-bench text) and end in different MT-bench questions; greedy, EOS ignored, a fixed
number of output tokens. Prints throughput, wall time, prefill tokens computed and the hit rate for
each setting, then the ratio, and checks both settings produce the same tokens.

    python benchmarks/prefix_cache.py [--num-requests 64] [--max-tokens 16] [--system-tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_mt_bench_prompts, machine_info, write_results  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.engine import Engine  # noqa: E402


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
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(None, num_kv_blocks=args.num_kv_blocks)
    prompts = build_prompts(llm, args.num_requests, args.system_tokens)
    off = run(llm, prompts, args.max_tokens, caching=False)
    on = run(llm, prompts, args.max_tokens, caching=True)
    print(f"{args.num_requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} output tokens each")
    print(f"{'prefix caching':>15} {'wall s':>8} {'out tok/s':>10} {'req/s':>7} {'prefill computed':>17} {'hit rate':>9}")
    for r in (off, on):
        print(f"{'on' if r['prefix_caching'] else 'off':>15} {r['wall_s']:8.1f} {r['output_tokens_per_s']:10.1f} "
              f"{r['requests_per_s']:7.2f} {r['prefill_tokens_computed']:17d} {r['hit_rate']:9.2f}")
    ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    same = on["tokens"] == off["tokens"]
    print(f"throughput ratio on/off: {ratio:.2f}x (target >= 3x); prefill tokens "
          f"{off['prefill_tokens_computed']} -> {on['prefill_tokens_computed']}; same tokens: {same}")
    for r in (off, on):
        r.pop("tokens")
    write_results({"machine": machine_info(), "args": vars(args) | {"json": None}, "off": off, "on": on,
                   "ratio": ratio, "same_tokens": same}, "prefix_cache", args.json)


if __name__ == "__main__":
    main()
