"""Speculative decoding (n-gram prompt lookup) against plain decoding, on the default model.

Workloads: input-grounded prompts (rewrite, summarise or correct a public-domain passage of 150-300
tokens; `benchmarks/data/grounded_passages.jsonl`, 16 prompts) and the MT-bench questions (little is
copied from the prompt). Greedy, 128 tokens. Three measurements, each alternating the two engines
(which share one model object) and reporting medians:

- single stream: each grounded prompt alone, tokens/s of each engine and the ratio;
- 16 concurrent grounded streams, and 16 concurrent MT-bench streams, submitted at once.

Outputs must be identical; the acceptance rate and mean accepted length are printed with the figures.
`--max-step-tokens 16,48,512` repeats the concurrent runs for several per-step caps (the policy).

    python benchmarks/speculative.py [--single 16] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATA_DIR, load_average, load_mt_bench_prompts, machine_info, median, write_results  # noqa: E402

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


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    """Submit all prompts at once and run them to the end: (seconds, outputs in order, speculation counters)."""
    from paged_backend import SamplingParams

    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    after = engine.stats()
    counters = {k: after[k] - before[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                 "spec_num_accepted_tokens")}
    return seconds, [finals[i] for i in ids], counters


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
    """Run every batch on both engines, alternating which goes first; tokens/s per engine over all batches
    (median over repeats), the ratio, whether outputs matched, and the speculation counters."""
    rates = {name: [] for name in engines}
    counters: dict = {}
    identical = True
    for rep in range(repeats):
        seconds = dict.fromkeys(engines, 0.0)
        tokens = dict.fromkeys(engines, 0)
        for b, batch in enumerate(batches):
            order = list(engines) if (rep + b) % 2 == 0 else list(engines)[::-1]
            outs = {}
            for name in order:
                s, outs[name], c = run_batch(engines[name], batch, max_tokens)
                seconds[name] += s
                tokens[name] += sum(len(o) for o in outs[name])
                if name == "ngram":
                    add_counters(counters, c)
            identical &= outs["plain"] == outs["ngram"]
        for name in engines:
            rates[name].append(tokens[name] / seconds[name])
    result = {f"{name}_tokens_per_s": round(median(r), 2) for name, r in rates.items()}
    result["ratio"] = round(median(rates["ngram"]) / median(rates["plain"]), 3)
    result["outputs_identical"] = identical
    result.update(acceptance(counters))
    result["load_average_1m"] = load_average()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--single", type=int, default=16, help="grounded prompts run one at a time (0 skips)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help="the speculative_config JSON (defaults fill the rest)")
    p.add_argument("--max-step-tokens", default=None,
                   help="comma-separated per-step caps to compare on the concurrent runs (default: the config's)")
    p.add_argument("--skip-mt-bench", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="results file (default benchmarks/results/speculative.json)")
    args = p.parse_args(argv)

    import torch

    from paged_backend import LLM, Engine, EngineConfig

    torch.set_num_threads(args.threads)
    llm = LLM(None, num_threads=args.threads)
    tokenizer = llm.tokenizer
    spec = json.loads(args.spec)
    caps = [int(c) for c in args.max_step_tokens.split(",")] if args.max_step_tokens else [None]

    def engines_for(cap: int | None) -> dict:
        config = dict(spec, **({"max_step_tokens": cap} if cap else {}))
        return {"plain": llm.engine,
                "ngram": Engine(llm.model, tokenizer, EngineConfig(num_threads=args.threads,
                                                                   speculative_config=config))}

    grounded = chat_ids(tokenizer, grounded_prompts())
    report: dict = {"model": "SmolLM2-135M-Instruct (fp32)", "max_tokens": args.max_tokens, "speculative_config": spec,
                    "threads": args.threads, "repeats": args.repeats}
    if args.single:
        engines = engines_for(None)
        report["single_stream"] = compare(engines, [[p] for p in grounded[: args.single]], args.max_tokens,
                                          args.repeats)
        report["single_stream"]["prompts"] = args.single
        print("single stream, grounded:", report["single_stream"], flush=True)
    mt_bench = None if args.skip_mt_bench else chat_ids(tokenizer, load_mt_bench_prompts(args.streams))
    for cap in caps:
        engines = engines_for(cap)
        label = f"max_step_tokens={engines['ngram'].config.speculative_config.max_step_tokens}"
        batch = (grounded * ((args.streams + len(grounded) - 1) // len(grounded)))[: args.streams]
        result = compare(engines, [batch], args.max_tokens, args.repeats)
        report.setdefault("concurrent_grounded", {})[label] = result
        print(f"{args.streams} streams, grounded, {label}:", result, flush=True)
        if mt_bench is not None:
            result = compare(engines, [mt_bench], args.max_tokens, args.repeats)
            report.setdefault("concurrent_mt_bench", {})[label] = result
            print(f"{args.streams} streams, MT-bench, {label}:", result, flush=True)
    report["machine"] = machine_info()
    print(f"\nresults: {write_results(report, 'speculative', args.json)}")


if __name__ == "__main__":
    main()
