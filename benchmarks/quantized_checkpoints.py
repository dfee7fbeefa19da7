"""A GPTQ 4-bit checkpoint of the default model's shape against the engine's own int4 path: one-stream decode
speed and memory, each side in its own process, rounds rotated. A third side loads the same folder with its LM
head made int8, as the int4 path's is: the difference to the int4 path is then the linear layers' alone.

The checkpoint is the default model's weights rounded to GPTQ 4-bit (symmetric, groups of `--group-size`,
the LM head and embeddings in fp16 as GPTQ tools leave them), written once by the test suite's writer
(tests/helpers/quantized_checkpoints.py). Each round starts one process per side, which loads its model
(`LLM(folder)`, the same with an int8 head, and `LLM()`, the default model's int4 at defaults), decodes `--tokens` greedy tokens of one
MT-bench prompt twice (the first warms up), and reports tokens/s of the second and its memory: resident after
loading (model, engine, compiled steps, the KV cache's written pages) and the peak while loading, each less the
process before loading. Printed: the medians, the ratio of speeds, and the memory against the checkpoint's file size.

    python benchmarks/quantized_checkpoints.py                # 3 rounds
    python benchmarks/quantized_checkpoints.py --rounds 5 --tokens 128

Writes benchmarks/results/quantized_checkpoints_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # `common` sits beside this script
sys.path.insert(0, str(ROOT.parent / "tests"))  # the checkpoint writer

from common import (  # noqa: E402
    current_rss_bytes,
    load_average,
    load_mt_bench_prompts,
    peak_rss_bytes,
    write_results,
)

# The GPTQ folder as it loads (its LM head in the model's dtype, as the checkpoint keeps it); the same with the
# head made int8 as the int4 path makes it, which isolates the linear layers' speed; the int4 path at defaults.
SIDES = ("gptq", "gptq-int8-head", "int4")


def write_checkpoint(folder: Path, group_size: int) -> int:
    """The default model as a GPTQ 4-bit folder; its files' size in bytes."""
    import torch
    from helpers.quantized_checkpoints import write_quantized

    from paged_backend.model.loading.model_loader import load_model

    model, tokenizer = load_model(None, dtype=torch.float32)
    write_quantized(model, folder, "gptq", bits=4, group_size=group_size, sym=True)
    tokenizer.save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def measure(side: str, folder: str, tokens: int) -> dict[str, Any]:
    """In this process: load one side, decode twice, the second timed."""
    from paged_backend import LLM, SamplingParams

    before = current_rss_bytes()
    llm = LLM(folder) if side == "gptq" else LLM(*int8_head_model(folder)) if side == "gptq-int8-head" else LLM()
    loaded, peak_loading = current_rss_bytes(), peak_rss_bytes()
    cache = llm.engine.runner.cache
    kv = sum(t.numel() * t.element_size() for t in (cache.kv, cache.kv_scales) if t is not None)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": load_mt_bench_prompts(1)[0]}], add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    return {"tok_s": len(out.token_ids) / seconds, "rss_before_load_bytes": before, "rss_loaded_bytes": loaded,
            "peak_rss_loading_bytes": peak_loading, "kv_cache_bytes": kv, "first_tokens": out.token_ids[:16]}


def int8_head_model(folder: str) -> tuple[Any, Any]:
    """The GPTQ folder loaded as LLM loads it, its LM head made int8 per row (the embedding keeps its weight)."""
    from paged_backend.model.loading.model_loader import load_model
    from paged_backend.model.quantized.int8_linear import Int8Linear

    model, tokenizer = load_model(folder)
    model.lm_head = Int8Linear.from_float(model.lm_head)
    return model, tokenizer


def run_side(side: str, folder: Path, tokens: int) -> dict[str, Any]:
    result = subprocess.run([sys.executable, __file__, "--measure", side, "--folder", str(folder),
                             "--tokens", str(tokens)], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of one side's rounds: tokens/s, and memory in MiB beyond the process before loading (resident
    after loading, and the peak while loading; the KV cache's pages count once written, so barely here)."""
    def mib(key: str) -> float:
        return statistics.median(r[key] - r["rss_before_load_bytes"] for r in runs) / 2**20

    return {"tok_s": statistics.median(r["tok_s"] for r in runs), "loaded_mib": mib("rss_loaded_bytes"),
            "peak_loading_mib": mib("peak_rss_loading_bytes"),
            "kv_mib": statistics.median(r["kv_cache_bytes"] for r in runs) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--measure", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.folder, args.tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        file_bytes = write_checkpoint(folder, args.group_size)
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        loads = []
        for round_ in range(args.rounds):
            for side in SIDES[round_ % len(SIDES):] + SIDES[:round_ % len(SIDES)]:
                loads.append(load_average())
                runs[side].append(run_side(side, folder, args.tokens))
                print(f"round {round_ + 1} {side:14s} {runs[side][-1]['tok_s']:7.1f} tok/s", flush=True)
    summary = {side: summarize(runs[side]) for side in SIDES}
    ratio = summary["gptq"]["tok_s"] / summary["int4"]["tok_s"]
    file_mib = file_bytes / 2**20
    head_ratio = summary["gptq-int8-head"]["tok_s"] / summary["int4"]["tok_s"]
    print(f"one stream: GPTQ 4-bit {summary['gptq']['tok_s']:.1f} tok/s, with an int8 head "
          f"{summary['gptq-int8-head']['tok_s']:.1f} tok/s, int4 path {summary['int4']['tok_s']:.1f} tok/s: ratios "
          f"{ratio:.2f} and {head_ratio:.2f}")
    print(f"memory beyond the process before loading: checkpoint files {file_mib:.1f} MiB, KV cache budget "
          f"{summary['gptq']['kv_mib']:.0f} MiB (resident only as it is written)")
    for side in ("gptq", "int4"):
        figures = summary[side]
        print(f"  {side:5s} resident after loading {figures['loaded_mib']:6.1f} MiB ({figures['loaded_mib'] / file_mib:.2f}x "
              f"the files), peak while loading {figures['peak_loading_mib']:6.1f} MiB "
              f"({figures['peak_loading_mib'] / file_mib:.2f}x)")
    same = runs["gptq"][0]["first_tokens"] == runs["int4"][0]["first_tokens"]
    write_results({"rounds": args.rounds, "tokens": args.tokens, "group_size": args.group_size, "runs": runs,
                   "summary": summary, "ratio_gptq_over_int4": ratio,
                   "ratio_gptq_int8_head_over_int4": head_ratio, "checkpoint_file_mib": file_mib,
                   "same_first_tokens": same,
                   "load_1m_range": [min(x for x in loads if x is not None), max(x for x in loads if x is not None)]
                   if any(x is not None for x in loads) else None},
                  "quantized_checkpoints")


if __name__ == "__main__":
    main()
