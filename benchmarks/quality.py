"""Quality of each precision against fp32: MT-bench answers, teacher-forced and free-running.

For every variant (weights in fp32 / bf16 / int8 / int4, KV cache in bf16 / int8) the engine
1. scores the fp32 engine's own greedy answers teacher-forced (prompt logprobs of prompt + answer):
   the mean |logprob difference| to fp32 over every answer token, and the share of answer positions
   where the variant's own top token, given fp32's answer so far, is fp32's token
   (`teacher_forced_agreement`: each position judged on its own, so one early difference does not
   decide the rest);
2. answers greedily itself: the share of the answer positions whose token equals fp32's
   (`agreement`; after a first difference the continuations usually part, so this also tracks how
   early they part) and the mean length of the identical prefix;
3. with `--speed-tokens N`, decodes one conversation of N tokens (median of `--repeats`, the variants
   alternating in one run, since the machine may be shared).

    python benchmarks/quality.py                       # 16 prompts, 128 tokens, every variant
    python benchmarks/quality.py --variants fp32,kv_int8 --num-prompts 4 --speed-tokens 64

Writes benchmarks/results/quality_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_mt_bench_prompts, write_results

# name -> LLM keywords; every variant runs eagerly unless its name says compiled.
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16", "quantization": None},  # not "auto", which makes the default model int4
    "int8": {"dtype": "float32", "quantization": "int8", "compile": False},
    "int8_compiled": {"dtype": "float32", "quantization": "int8", "compile": True},
    # The default model's own Q4_1 weights (int4_linear.py), with bf16 activations.
    "int4": {"dtype": "bfloat16", "quantization": "int4", "compile": False},
    "int4_compiled": {"dtype": "bfloat16", "quantization": "int4", "compile": True},
    # The same codes with fp32 activations and fp32 dense copies: the default where bf16 is not native.
    "int4_fp32": {"dtype": "float32", "quantization": "int4", "compile": False},
    "kv_bf16": {"dtype": "float32", "kv_cache_dtype": "bf16"},
    "kv_int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
}
DEFAULT_VARIANTS = ("fp32", "bf16", "int8", "int4", "int4_fp32", "kv_bf16", "kv_int8")


def make_llm(model: str | None, variant: str, num_kv_blocks: int):
    from paged_backend import LLM

    options = {"compile": False, **VARIANTS[variant]}
    return LLM(model, num_kv_blocks=num_kv_blocks, **options)


def greedy(max_tokens: int):
    from paged_backend import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def answer(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def score(llm, prompts: list[list[int]], answers: list[list[int]]) -> tuple[list[list[float]], list[list[int]]]:
    """Teacher-forced, for each answer token given the prompt and the answer before it: its logprob, and
    the model's own top token at that position."""
    from paged_backend import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([p + a for p, a in zip(prompts, answers)], params, use_tqdm=False)
    rows = [[out.prompt_logprobs[len(p) + i] for i in range(len(a))] for out, p, a in zip(outputs, prompts, answers)]
    logprobs = [[row[token].logprob for row, token in zip(r, a)] for r, a in zip(rows, answers)]
    tops = [[next(t for t, lp in row.items() if lp.rank == 1) for row in r] for r in rows]
    return logprobs, tops


def decode_speed(llm, prompt: list[int], tokens: int) -> float:
    start = time.perf_counter()
    answer(llm, [prompt], tokens)
    return tokens / (time.perf_counter() - start)


def compare(reference: dict[str, Any], run: dict[str, Any]) -> dict[str, float]:
    diffs = [abs(a - b) for ref, got in zip(reference["logprobs"], run["logprobs"]) for a, b in zip(ref, got)]
    same = [sum(x == y for x, y in zip(ref, got)) for ref, got in zip(reference["answers"], run["answers"])]
    prefixes = [next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), len(ref))
                for ref, got in zip(reference["answers"], run["answers"])]
    total = sum(len(ref) for ref in reference["answers"])
    # The reference answers are fp32's greedy tokens, so a teacher-forced top token equal to the answer
    # token is the variant choosing what fp32 chose from the same context.
    forced = sum(x == y for ref, top in zip(reference["scored_answers"], run["tops"]) for x, y in zip(ref, top))
    return {"mean_abs_dlogprob": statistics.fmean(diffs), "max_abs_dlogprob": max(diffs),
            "teacher_forced_agreement": forced / total,
            "agreement": sum(same) / total, "identical_prefix_mean": statistics.fmean(prefixes)}


def run_quality(model: str | None, prompts: list[list[int]], variants: Sequence[str], max_tokens: int,
                speed_tokens: int = 0, repeats: int = 3, num_kv_blocks: int = 1024) -> dict[str, Any]:
    """Every variant's numbers against fp32 (which runs first, as the reference)."""
    variants = ["fp32", *[v for v in variants if v != "fp32"]]
    runs: dict[str, dict[str, Any]] = {}
    llms = {}
    for variant in variants:
        llm = make_llm(model, variant, num_kv_blocks)
        reference = runs.get("fp32")
        answers = answer(llm, prompts, max_tokens)
        scored_answers = reference["answers"] if reference else answers
        logprobs, tops = score(llm, prompts, scored_answers)
        runs[variant] = {"answers": answers, "scored_answers": scored_answers, "logprobs": logprobs, "tops": tops,
                         "dtype": str(llm.model.dtype),
                         "kv_cache_dtype": str(llm.engine.cache.kv.dtype)}
        if speed_tokens:
            llms[variant] = llm
        else:
            del llm
            gc.collect()
    if speed_tokens:
        speeds: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(repeats):  # alternate, so load changes hit every variant alike
            for variant, llm in llms.items():
                speeds[variant].append(decode_speed(llm, prompts[0], speed_tokens))
        for variant in variants:
            runs[variant]["tokens_per_s_runs"] = speeds[variant]
            runs[variant]["tokens_per_s"] = statistics.median(speeds[variant])
    report = {}
    for variant in variants:
        summary = {k: v for k, v in runs[variant].items() if k not in ("answers", "scored_answers", "logprobs", "tops")}
        report[variant] = {**summary, **compare(runs["fp32"], runs[variant])}
    return report


def chat_prompts(model: str | None, num_prompts: int) -> list[list[int]]:
    from paged_backend.model.loading.model_loader import load_model

    _, tokenizer = load_model(model, device="cpu", dtype="float32")
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
            for text in load_mt_bench_prompts(num_prompts)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: the default model)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--speed-tokens", type=int, default=0, help="also time one conversation of N tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default: benchmarks/results/quality_<machine class>.json)")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    load_start = os.getloadavg()[0]
    report = run_quality(args.model, chat_prompts(args.model, args.num_prompts), variants, args.max_tokens,
                         args.speed_tokens, args.repeats)
    result = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "speed_tokens": args.speed_tokens,
              "threads": torch.get_num_threads(), "load_1m_start": load_start, "load_1m_end": os.getloadavg()[0],
              "variants": report}
    path = write_results(result, "quality", args.json)
    print(f"{'variant':<14} {'mean|dlogp|':>11} {'forced':>7} {'agreement':>9} {'prefix':>7} {'tok/s':>7}")
    for name, r in report.items():
        speed = f"{r['tokens_per_s']:7.1f}" if "tokens_per_s" in r else "      -"
        print(f"{name:<14} {r['mean_abs_dlogprob']:11.4f} {r['teacher_forced_agreement']:7.1%} {r['agreement']:9.1%} {r['identical_prefix_mean']:7.1f} "
              f"{speed}")
    print(f"load average {result['load_1m_start']:.1f} -> {result['load_1m_end']:.1f}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
