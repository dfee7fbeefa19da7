"""Speculative decoding (n-gram prompt lookup) against plain decoding, on the default model.

Workloads: input-grounded prompts (rewrite, summarise or correct a public-domain passage of 150-300
tokens; `benchmarks/data/grounded_passages.jsonl`, 16 prompts) and the MT-bench questions (little is
copied from the prompt). Greedy, 128 tokens. Three measurements; the engines (which share one model object) run the same
requests at once, one step of each in turn, each timed over its own steps (so a load that changes
while the benchmark runs falls on all of them alike); medians over repeats:

- single stream: each grounded prompt alone, tokens/s of each engine and the ratio;
- 16 concurrent grounded streams, and 16 concurrent MT-bench streams, submitted at once.

Outputs must be identical; the acceptance rate and mean accepted length are printed with the figures.
`--variants '{"cap48": {"max_step_tokens": 48}, ...}'` compares several policies with plain in the same
runs (interleaved step by step), each a set of overrides of `--spec`.

    python benchmarks/speculative.py [--single 16] [--repeats 3] [--threads 2] [--variants JSON]
                                     [--precision fp32|default]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DATA_DIR,
    load_average,
    load_mt_bench_prompts,
    machine_info,
    median,
    precision_name,
    write_results,
)

PASSAGES = DATA_DIR / "grounded_passages.jsonl"
INSTRUCTIONS = {
    "rewrite": "Rewrite the following passage in plain modern English, sentence by sentence:",
    "summarise": "Summarise the following passage, quoting its key sentences:",
    "correct": "Correct the spelling and grammar mistakes in the following passage and write it out in full:",
}


def grounded_prompts() -> list[str]:
    rows = [json.loads(line) for line in PASSAGES.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [f"{INSTRUCTIONS[r['task']]}\n\n{r['passage']}" for r in rows]


def chat_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in prompts]


def acceptance(counters: dict) -> dict:
    drafts, proposed, accepted = (counters["spec_num_drafts"], counters["spec_num_draft_tokens"],
                                  counters["spec_num_accepted_tokens"])
    return {"proposed": proposed, "accepted": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0}


def add_counters(total: dict, part: dict) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


def compare(engines: dict, batches: list[list[list[int]]], max_tokens: int, repeats: int) -> dict:
    """Run every batch on every engine ("plain" first in `engines`, then speculating ones) at once, one step
    of each engine in turn, timing each engine's own steps: a machine whose load changes from minute to
    minute slows every engine alike. Tokens/s per engine over all batches (median over repeats), each
    speculating engine's ratio to plain, whether outputs matched, and the speculation counters."""
    names = list(engines)
    rates = {name: [] for name in names}
    counters: dict = {name: {} for name in names}
    identical = True
    for _ in range(repeats):
        seconds = dict.fromkeys(names, 0.0)
        tokens = dict.fromkeys(names, 0)
        for batch in batches:
            outs, elapsed, c = run_interleaved(engines, batch, max_tokens)
            for name in names:
                seconds[name] += elapsed[name]
                tokens[name] += sum(len(o) for o in outs[name])
                add_counters(counters[name], c[name])
            identical &= all(outs[name] == outs["plain"] for name in names)
        for name in names:
            rates[name].append(tokens[name] / seconds[name])
    result = {"plain_tokens_per_s": round(median(rates["plain"]), 2), "outputs_identical": identical}
    for name in names[1:]:
        result[name] = {"tokens_per_s": round(median(rates[name]), 2),
                        "ratio": round(median(rates[name]) / median(rates["plain"]), 3), **acceptance(counters[name])}
    result["load_average_1m"] = load_average()
    return result


def run_interleaved(engines: dict, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict, dict]:
    """All prompts submitted to every engine, then one step of each engine in turn until all are done:
    (outputs per engine, seconds spent in each engine's steps, speculation counters per engine)."""
    from paged_backend import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for engine in engines.values():
        engine.reset_prefix_cache()  # prompts run before (an earlier repeat or workload) are computed again
    before = {name: engine.stats() for name, engine in engines.items()}
    ids = {name: [engine.add_request(p, params) for p in prompts] for name, engine in engines.items()}
    finals: dict = {name: {} for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    while any(engine.has_unfinished_requests() for engine in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outputs = engine.step()
            seconds[name] += time.perf_counter() - start
            finals[name].update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
    counters = {}
    for name, engine in engines.items():
        after = engine.stats()
        counters[name] = {k: after[k] - before[name][k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                                   "spec_num_accepted_tokens")}
    return {name: [finals[name][i] for i in ids[name]] for name in engines}, seconds, counters


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--single", type=int, default=16, help="grounded prompts run one at a time (0 skips)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help="the speculative_config JSON (defaults fill the rest)")
    p.add_argument("--variants", default=None,
                   help='JSON object {label: overrides of --spec}: speculating engines compared with plain in the same '
                        'runs, interleaved step by step (default: {"spec": {}})')
    p.add_argument("--skip-mt-bench", action="store_true")
    p.add_argument("--precision", choices=("fp32", "default"), default="fp32",
                   help="the model's precision: fp32, or the engine's default on this CPU (int4 weights)")
    p.add_argument("--json", type=Path, default=None, help="results file (default benchmarks/results/speculative_<machine class>.json)")
    args = p.parse_args(argv)

    import torch

    from paged_backend import LLM, Engine, EngineConfig

    torch.set_num_threads(args.threads)
    # fp32, or what the engine picks by default on this CPU (int4 where it computes bf16 natively).
    precision = {"dtype": torch.float32} if args.precision == "fp32" else {}
    llm = LLM(None, num_threads=args.threads, **precision)
    tokenizer = llm.tokenizer
    spec = json.loads(args.spec)
    variants = json.loads(args.variants) if args.variants else {"spec": {}}

    def engines_for() -> dict:
        engines = {"plain": llm.engine}
        for label, overrides in variants.items():
            engines[label] = Engine(llm.model, tokenizer, EngineConfig(num_threads=args.threads,
                                                                       speculative_config={**spec, **overrides}))
        return engines

    grounded = chat_ids(tokenizer, grounded_prompts())
    report: dict = {"model": f"SmolLM2-135M-Instruct ({precision_name(llm.model)})", "max_tokens": args.max_tokens,
                    "speculative_config": spec,
                    "variants": variants, "threads": args.threads, "repeats": args.repeats}
    engines = engines_for()
    if args.single:
        report["single_stream"] = compare(engines, [[p] for p in grounded[: args.single]], args.max_tokens,
                                          args.repeats)
        report["single_stream"]["prompts"] = args.single
        print("single stream, grounded:", report["single_stream"], flush=True)
    batch = (grounded * ((args.streams + len(grounded) - 1) // len(grounded)))[: args.streams]
    report["concurrent_grounded"] = compare(engines, [batch], args.max_tokens, args.repeats)
    print(f"{args.streams} streams, grounded:", report["concurrent_grounded"], flush=True)
    if not args.skip_mt_bench:
        mt_bench = chat_ids(tokenizer, load_mt_bench_prompts(args.streams))
        report["concurrent_mt_bench"] = compare(engines, [mt_bench], args.max_tokens, args.repeats)
        print(f"{args.streams} streams, MT-bench:", report["concurrent_mt_bench"], flush=True)
    report["machine"] = machine_info()
    print(f"\nresults: {write_results(report, 'speculative', args.json)}")


if __name__ == "__main__":
    main()
