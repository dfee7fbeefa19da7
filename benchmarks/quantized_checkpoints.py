"""Quantized checkpoints of the default model against the engine's own int4 path: one-stream decode speed and
memory, each side in its own process, rounds rotated. The checkpoints: GPTQ 4-bit (the int4 kernels), GPTQ 8-bit
and FP8 (compressed-tensors, per row; both `DequantizingLinear`, whose decode steps run the 8-bit codes kernel). One more side loads the GPTQ 4-bit folder
with its LM head made int8, as the int4 path's is: its difference to the int4 path is the linear layers' alone. On a
CPU without native bf16 the engine keeps the checkpoint's fp16 head in fp16 (model/quantized/half_head.py); one
more side there hands LLM the model loaded with its head widened to fp32 (a caller's model keeps its head), as the
engine ran it before.

Each checkpoint is the default model's weights rounded round-to-nearest (GPTQ symmetric in groups of
`--group-size`, its LM head and embeddings in fp16 as GPTQ tools leave them; FP8 a scale per row, the rest in
bf16), written once by the test suite's writer (tests/helpers/quantized_checkpoints.py). Each round starts one
process per side, which loads its model (`LLM(folder)`, the GPTQ 4-bit one with an int8 head, or `LLM()`, the
default model's int4 at defaults), decodes `--tokens` greedy tokens of one MT-bench prompt twice (the first
warms up), and reports tokens/s of the second and its memory: resident after loading (model, engine, compiled
steps, the KV cache's written pages) and the peak while loading, each less the process before loading.
Printed: the medians, the speed ratios, and the memory against each checkpoint's file size.

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

# The checkpoints written, by side: GPTQ 4-bit (the int4 kernels), GPTQ 8-bit and FP8 (DequantizingLinear).
CHECKPOINTS = {"gptq": ("gptq", {"bits": 4}), "gptq-8bit": ("gptq", {"bits": 8}),
               "fp8": ("ct-fp8", {"strategy": "channel"})}
# Each checkpoint as it loads (its fp16 LM head as the checkpoint keeps it: in fp16 where the model computes in fp32,
# else in the model's dtype); the GPTQ 4-bit one with its head widened to fp32 (a model object handed to LLM), and
# with its head made int8 as the int4 path makes it, which isolates the linear layers' speed; the int4 path at
# defaults.
SIDES = ("gptq", "gptq-fp32-head", "gptq-int8-head", "gptq-8bit", "fp8", "int4")


def write_checkpoints(root: Path, group_size: int) -> dict[str, int]:
    """The default model in each of CHECKPOINTS' formats, a folder each under `root`; their files' sizes."""
    import torch
    from helpers.quantized_checkpoints import write_quantized

    from paged_backend.model.loading.model_loader import load_model

    model, tokenizer = load_model(None, dtype=torch.float32)
    sizes = {}
    for name, (fmt, options) in CHECKPOINTS.items():
        folder = root / name
        group = {} if fmt == "ct-fp8" else {"group_size": group_size, "sym": True}
        write_quantized(model, folder, fmt, **options, **group)
        tokenizer.save_pretrained(folder)
        sizes[name] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return sizes


def folder_of(side: str, root: Path) -> Path:
    return root / ("gptq" if side in ("gptq-int8-head", "gptq-fp32-head") else side)


def measure(side: str, folder: str, tokens: int) -> dict[str, Any]:
    """In this process: load one side, decode twice, the second timed."""
    from paged_backend import LLM, SamplingParams

    before = current_rss_bytes()
    if side == "int4":
        llm = LLM()
    else:
        llm = LLM(*head_model(folder, side == "gptq-int8-head")) if side.endswith("-head") else LLM(folder)
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
    return {"tok_s": len(out.token_ids) / seconds, "lm_head": describe_head(llm.model.get_output_embeddings()),
            "rss_before_load_bytes": before, "rss_loaded_bytes": loaded,
            "peak_rss_loading_bytes": peak_loading, "kv_cache_bytes": kv, "first_tokens": out.token_ids[:16]}


def describe_head(head: Any) -> str:
    """The LM head's class and the dtype of the weight it multiplies by (a 16-bit head's, an int8 head's codes)."""
    weight = next(t for t in (getattr(head, name, None) for name in ("weight16", "codes", "weight")) if t is not None)
    return f"{type(head).__name__} ({str(weight.dtype).removeprefix('torch.')})"


def head_model(folder: str, int8: bool) -> tuple[Any, Any]:
    """The GPTQ folder loaded as LLM loads it, handed over as a model object, whose LM head LLM keeps as it is: in
    the model's dtype, or made `int8` per row (the embedding keeps its weight)."""
    from paged_backend.model.loading.model_loader import load_model
    from paged_backend.model.quantized.int8_linear import Int8Linear

    model, tokenizer = load_model(folder)
    if int8:
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
        root = Path(tmp)
        sizes = write_checkpoints(root, args.group_size)
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        loads = []
        for round_ in range(args.rounds):
            for side in SIDES[round_ % len(SIDES):] + SIDES[:round_ % len(SIDES)]:
                loads.append(load_average())
                runs[side].append(run_side(side, folder_of(side, root), args.tokens))
                print(f"round {round_ + 1} {side:14s} {runs[side][-1]['tok_s']:7.1f} tok/s", flush=True)
    summary = {side: summarize(runs[side]) for side in SIDES}
    ratios = {side: summary[side]["tok_s"] / summary["int4"]["tok_s"] for side in SIDES}
    print("one stream against the int4 path: " + ", ".join(f"{side} {summary[side]['tok_s']:.1f} tok/s "
                                                           f"({ratios[side]:.2f}x)" for side in SIDES))
    print(f"memory beyond the process before loading (KV cache budget {summary['gptq']['kv_mib']:.0f} MiB, "
          "resident only as it is written):")
    for side in SIDES:
        if side.endswith("-head"):
            continue
        figures, files = summary[side], sizes.get(side)
        against = f" ({figures['loaded_mib'] / files * 2**20:.2f}x / {figures['peak_loading_mib'] / files * 2**20:.2f}x " \
                  f"its {files / 2**20:.1f} MiB of files)" if files else ""
        print(f"  {side:9s} resident after loading {figures['loaded_mib']:6.1f} MiB, peak while loading "
              f"{figures['peak_loading_mib']:6.1f} MiB{against}")
    same = runs["gptq"][0]["first_tokens"] == runs["int4"][0]["first_tokens"]
    write_results({"rounds": args.rounds, "tokens": args.tokens, "group_size": args.group_size, "runs": runs,
                   "summary": summary, "ratios_over_int4": ratios, "ratio_gptq_over_int4": ratios["gptq"],
                   "ratio_gptq_int8_head_over_int4": ratios["gptq-int8-head"],
                   "ratio_gptq_fp32_head_over_int4": ratios["gptq-fp32-head"],
                   "lm_head": {side: runs[side][0]["lm_head"] for side in SIDES},
                   "checkpoint_file_mib": sizes["gptq"] / 2**20,
                   "file_mib": {name: size / 2**20 for name, size in sizes.items()},
                   "same_first_tokens": same,
                   "load_1m_range": [min(x for x in loads if x is not None), max(x for x in loads if x is not None)]
                   if any(x is not None for x in loads) else None},
                  "quantized_checkpoints")


if __name__ == "__main__":
    main()
