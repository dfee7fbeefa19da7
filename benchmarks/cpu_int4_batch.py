"""The compiled CPU int4 matmul (kernels/cpu_int4_matmul.py) against torch's `_weight_int4pack_mm_for_cpu`.

1. The default model's projections (30 layers of fused q/k/v, o, fused gate/up and down, each layer its own
   weights so that they stream from memory as in a step) at several row counts: the kernel, torch's int4
   kernel and the dense copy (bf16 where the CPU has native bf16, else fp32, as the engine keeps it),
   alternating, medians of `--repeats` passes (ms per pass over all 120).
2. The engine at its defaults (compiled, int4, bf16 where the CPU has it) with the kernel and without it: two engines in one
   process, the second made inside `cpu_int4_matmul.switched_off()` (its layers hold no tiles, so its graphs
   call torch's kernel), alternating, medians: the throughput workload (throughput.py's 32 chats, every
   prompt computed each round) and one greedy stream of `--tokens` tokens. Whether the answers agree.

    python benchmarks/cpu_int4_batch.py                 # 5 rounds each
    python benchmarks/cpu_int4_batch.py --repeats 3 --rows 1,8,32

Writes benchmarks/results/cpu_int4_batch_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

from common import alternate, load_average, load_mt_bench_prompts, write_results

from paged_backend.kernels import cpu_int4_matmul

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out): q/k/v, o, gate/up, down of the default model
PATHS = ("kernel", "torch")


def dense_dtype() -> torch.dtype:
    """The dtype of the engine's dense copies here: the model's, bf16 only where the CPU has it natively."""
    from paged_backend.model.loading.precision import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def projections() -> list[dict[str, Any]]:
    """Random int4 weights of the default model's projection shapes, each way the step could multiply them."""
    from paged_backend.model.quantized.int4_linear import dequantize

    g = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        for in_features, out_features in SHAPES:
            codes = torch.randint(0, 16, (out_features, in_features), generator=g)
            scale = (torch.rand(out_features, in_features // 32, generator=g) * 0.02).bfloat16()
            zero = (torch.randn(out_features, in_features // 32, generator=g) * 0.05).bfloat16()
            weights.append({"in": in_features, "tiled": cpu_int4_matmul.tile(codes, scale, zero),
                            "packed": torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1),
                            "scales_and_zeros": torch.stack([scale, zero], -1).transpose(0, 1).contiguous(),
                            "dense": dequantize(codes, scale, zero).to(dense_dtype())})
    return weights


def matmuls(rows_list: Sequence[int], repeats: int) -> dict[str, Any]:
    """ms per pass over the 120 projections at each row count, three ways."""
    weights = projections()
    results = {}
    for rows in rows_list:
        inputs = {n: torch.randn(rows, n).bfloat16() for n in {s[0] for s in SHAPES}}
        dense_inputs = {n: x.to(dense_dtype()) for n, x in inputs.items()}
        ways = {
            "kernel": lambda w: cpu_int4_matmul.int4_matmul(inputs[w["in"]], *w["tiled"]),
            "torch int4": lambda w: torch._weight_int4pack_mm_for_cpu(inputs[w["in"]], w["packed"], 32,
                                                                      w["scales_and_zeros"]),
            f"dense {str(dense_dtype()).removeprefix('torch.')}": lambda w: F.linear(dense_inputs[w["in"]], w["dense"]),
        }

        def timed(way: Callable[[dict[str, Any]], torch.Tensor]) -> Callable[[], float]:
            def run() -> float:
                start = time.perf_counter()
                for w in weights:
                    way(w)
                return (time.perf_counter() - start) * 1e3
            return run

        for way in ways.values():
            timed(way)()  # warm-up
        figures = alternate({name: timed(way) for name, way in ways.items()}, repeats)
        results[rows] = {name: statistics.median(v) for name, v in figures.items()}
        line = ", ".join(f"{name} {ms:.1f}" for name, ms in results[rows].items())
        print(f"{rows:4d} rows, ms per pass: {line}; torch int4 / kernel {results[rows]['torch int4'] / results[rows]['kernel']:.2f}x",
              flush=True)
    return results


def engines(repeats: int, tokens: int) -> dict[str, Any]:
    """Tokens/s of the throughput workload and of one stream, with the kernel and with torch's."""
    from throughput import FULL_WORKLOAD, default_workload

    from paged_backend import LLM, SamplingParams
    from paged_backend.model.loading.default_model import default_model_path

    llms = {"kernel": LLM(None)}
    with cpu_int4_matmul.switched_off():
        llms["torch"] = LLM(None)
    workload = default_workload(**FULL_WORKLOAD, model_source=str(default_model_path()))
    batch = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    chat = [{"role": "user", "content": load_mt_bench_prompts(1)[0]}]
    stream_prompt = llms["kernel"].tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    stream = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    answers: dict[str, dict[str, list[list[int]]]] = {"throughput": {}, "one_stream": {}}

    def timed(name: str, figure: str) -> Callable[[], float]:
        prompts, params = ((workload.prompt_token_ids, batch) if figure == "throughput" else ([stream_prompt], stream))

        def run() -> float:
            llms[name].reset_prefix_cache()
            start = time.perf_counter()
            outs = llms[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            answers[figure][name] = [list(o.outputs[0].token_ids) for o in outs]
            return sum(len(a) for a in answers[figure][name]) / elapsed
        return run

    results: dict[str, Any] = {}
    for figure in answers:
        for name in PATHS:
            timed(name, figure)()  # warm-up
        rates = alternate({name: timed(name, figure) for name in PATHS}, repeats)
        same = sum(a == b for a, b in zip(answers[figure]["kernel"], answers[figure]["torch"]))
        results[figure] = {"tokens_per_s": rates, "median_tokens_per_s": {n: statistics.median(v) for n, v in rates.items()},
                           "answers_equal": f"{same} of {len(answers[figure]['kernel'])}"}
        median = results[figure]["median_tokens_per_s"]
        print(f"{figure}: kernel {median['kernel']:.1f} tok/s, torch {median['torch']:.1f} tok/s = "
              f"{median['kernel'] / median['torch']:.2f}x; answers equal: {results[figure]['answers_equal']}", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512", help="row counts of part 1")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--skip-engine", action="store_true", help="part 1 only")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if cpu_int4_matmul.library() is None:
        raise SystemExit("the int4 kernel does not run here (neither AVX512-BF16 nor AVX2, no C compiler, or "
                         "PAGED_BACKEND_CPU_KERNEL=0)")
    load_start = load_average()
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": args.repeats,
                               "matmul_ms_per_pass": matmuls([int(r) for r in args.rows.split(",")], args.repeats)}
    if not args.skip_engine:
        results["engine"] = engines(args.repeats, args.tokens)
    results["load_1m_start"], results["load_1m_end"] = load_start, load_average()
    print(f"threads {results['threads']}; load average {load_start:.1f} -> {results['load_1m_end']:.1f}; "
          f"wrote {write_results(results, 'cpu_int4_batch', args.json)}")
    return results


if __name__ == "__main__":
    main()
