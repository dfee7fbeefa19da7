"""Offline throughput: HF generate (static batches / one at a time), transformers' continuous batching, this engine.

Every system runs the same seeded workload (MT-bench first turns through the chat template, greedy, EOS
ignored, per-request max_tokens drawn from a fixed range), each in its own process so peak memory is its
own. The engine's run also records how many tokens each of its steps packed; the same packed forwards
timed on the bare model, with no engine around it, give the dense-forward floor.

    python benchmarks/throughput.py                    # 32 prompts, max_tokens 16..128, all systems
    python benchmarks/throughput.py --quick            # 8 prompts, max_tokens 16..32
    python benchmarks/throughput.py --systems sequential,engine --json /tmp/t.json

Throughput counts useful tokens only: each request's own max_tokens, however many a padded batch computed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

import charts
from common import (
    RunMeter,
    Workload,
    chat_workload,
    draw_max_tokens,
    load_mt_bench_prompts,
    machine_info,
    median,
    peak_rss_bytes,
    run_json_subprocess,
    time_medians,
    write_results,
)

SYSTEMS: tuple[str, ...] = ("sequential", "static", "hf_cb", "engine", "engine_compiled")
LABELS: dict[str, str] = {
    "sequential": "HF generate, one at a time",
    "static": "HF generate, static batches of 8",
    "hf_cb": "transformers continuous batching",
    "engine": "paged-backend engine",
    "engine_compiled": "paged-backend engine, compiled",
}
REFERENCE = "sequential"
STATIC_BATCH_SIZE = 8
SEED = 0
FULL_WORKLOAD = {"num_prompts": 32, "low": 16, "high": 128}
QUICK_WORKLOAD = {"num_prompts": 8, "low": 16, "high": 32}
MB = 1e6

# (label, report key path, comparison, bound)
TARGETS: tuple[tuple[str, tuple[str, ...], str, float], ...] = (
    ("engine vs static batches (x)", ("ratios", "engine_vs_static"), ">=", 2.2),
    ("engine vs transformers CB (x)", ("ratios", "engine_vs_hf_cb"), ">=", 2.0),
    ("compiled engine vs eager engine (x)", ("ratios", "compiled_vs_engine"), ">=", 1.2),
    ("engine time / dense floor", ("systems", "engine", "engine_over_floor"), "<=", 1.3),
    ("engine peak RSS (MB)", ("systems", "engine", "peak_rss_mb"), "<", 1500.0),
    ("engine first-request TTFT (s)", ("systems", "engine", "ttft_first_s"), "<=", 2.0),
    ("engine KV utilisation", ("systems", "engine", "kv_utilisation_mean"), ">=", 0.95),
)


@dataclass(slots=True)
class Options:
    """Knobs of a run besides the workload; every one is honoured by the system it names."""

    cb_num_blocks: int | None = None  # transformers CB cache size; None keeps its default (60% of free RAM)
    floor_repeats: int = 3  # timings per distinct packed-forward shape when measuring the floor
    block_size: int | None = None  # the engine's KV block size; None keeps EngineConfig's default


# ------------------------------------------------------------------ shared pieces of the systems


def load_hf_model(source: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa").eval()


# Every system first serves this untimed request through its own path, so none pays first-call costs
# (math-library set-up, lazy imports, kernel selection) inside its timing.
WARM_UP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
WARM_UP_TOKENS = 2


def greedy_config(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    # eos_token_id=[] is how generate runs to max_new_tokens without banning EOS (min_new_tokens would ban it
    # and change the tokens); the engine's ignore_eos does the same.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=pad_token_id)


class FirstTokenClock(BaseStreamer):
    """A generate streamer that notes when the first new tokens arrive (its first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def system_result(tokens: list[list[int]], ttft_s: list[float], setup_s: float, meter: RunMeter,
                  **extra: Any) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "ttft_s": ttft_s,
        "setup_s": setup_s,
        # The process high-water mark covers loading and running; each system has its own process.
        "peak_rss_mb": peak_rss_bytes() / MB,
        **meter.summary(),
        **extra,
    }


# ------------------------------------------------------------------ the systems


def run_hf_generate(source: str, workload: Workload, batch_size: int) -> dict[str, Any]:
    """`generate` over consecutive batches; each batch runs to its longest request, left-padded."""

    def set_up():
        model = load_hf_model(source)
        warm_ids, warm_mask = left_pad([WARM_UP_PROMPT], workload.pad_token_id)
        model.generate(warm_ids, attention_mask=warm_mask,
                       generation_config=greedy_config(WARM_UP_TOKENS, workload.pad_token_id))
        return model

    model, setup_s = timed(set_up)
    n = workload.num_requests
    tokens: list[list[int]] = [[] for _ in range(n)]
    ttft = [0.0] * n
    computed = 0
    with RunMeter() as meter:
        for first in range(0, n, batch_size):
            rows = range(first, min(first + batch_size, n))
            ids, mask = left_pad([workload.prompt_token_ids[i] for i in rows], workload.pad_token_id)
            new = max(workload.max_tokens[i] for i in rows)
            clock = FirstTokenClock()
            out = model.generate(ids, attention_mask=mask, generation_config=greedy_config(new, workload.pad_token_id),
                                 streamer=clock)
            computed += new * len(rows)
            for row, i in enumerate(rows):
                tokens[i] = out[row, ids.shape[1]: ids.shape[1] + workload.max_tokens[i]].tolist()
                ttft[i] = clock.first_token_time - meter.start
    return system_result(tokens, ttft, setup_s, meter, computed_tokens=computed)


def run_sequential(source: str, workload: Workload, options: Options) -> dict[str, Any]:
    return run_hf_generate(source, workload, batch_size=1)


def run_static(source: str, workload: Workload, options: Options) -> dict[str, Any]:
    return run_hf_generate(source, workload, batch_size=STATIC_BATCH_SIZE)


def run_hf_cb(source: str, workload: Workload, options: Options) -> dict[str, Any]:
    """transformers' ContinuousBatchingManager, with its own sdpa model and, unless told, its default cache size."""
    manager, setup_s = timed(lambda: start_hf_cb(source, workload, options))
    try:
        with RunMeter() as meter:
            outs = serve_hf_cb(manager, workload)
        cache_bytes = manager.batch_processor.cache.cache_tensor.nbytes
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return system_result([list(o.generated_tokens) for o in outs], [o.timestamps[0] - meter.start for o in outs],
                         setup_s, meter, kv_cache_mb=cache_bytes / MB)


def start_hf_cb(source: str, workload: Workload, options: Options):
    from transformers import ContinuousBatchingConfig

    model = load_hf_model(source)
    cb_config = ContinuousBatchingConfig(num_blocks=options.cb_num_blocks)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_tokens),
                                  pad_token_id=workload.pad_token_id, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.warmup()  # what its context manager does by default; it also allocates the cache
    manager.start()
    manager.add_request(WARM_UP_PROMPT, request_id="warm-up", max_new_tokens=WARM_UP_TOKENS, eos_token_id=-1)
    while (result := manager.get_result(request_id="warm-up", timeout=30)) is None or not result.is_finished():
        if not manager.is_running():
            raise RuntimeError("transformers CB generation loop stopped during warm-up")
    return manager


def serve_hf_cb(manager, workload: Workload) -> list:
    """Submit every request (eos_token_id=-1 ignores EOS) and return the finished outputs in request order."""
    n = workload.num_requests
    # Paused, so the loop sees every request at once, as the other systems do.
    with manager.pause():
        for i in range(n):
            manager.add_request(workload.prompt_token_ids[i], request_id=str(i),
                                max_new_tokens=workload.max_tokens[i], eos_token_id=-1, record_timestamps=True)
    results = {}
    while len(results) < n:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers CB generation loop stopped before finishing")
    return [results[str(i)] for i in range(n)]


def run_engine(source: str, workload: Workload, options: Options, compile: bool | None = None) -> dict[str, Any]:
    """This engine at its default EngineConfig (`compile` overrides that knob); then the dense-forward floor
    (eager) of the steps it ran."""
    engine, setup_s = timed(lambda: make_engine(source, options.block_size, compile))
    steps = record_steps(engine)
    with RunMeter() as meter:
        outs = serve_engine(engine, workload, meter.start_epoch)
    stats = engine.stats()
    # Built before the floor runs, so the floor's forwards do not count toward the engine's memory.
    result = system_result([list(o.outputs[0].token_ids) for o in outs],
                           [o.metrics.first_token_time - meter.start_epoch for o in outs], setup_s, meter,
                           kv_utilisation_mean=stats["kv_utilisation_mean"], num_preemptions=stats["num_preemptions"],
                           kv_cache_mb=engine.cache.kv.nbytes / MB, block_size=engine.config.block_size,
                           num_steps=len(steps), step_tokens=[t for t, _, _ in steps],
                           step_s=[round(s, 4) for _, _, s in steps], forward_s=sum(s for _, _, s in steps),
                           compile_s=engine.runner_start.compile_s)
    floor = measure_floor(engine.model, [(t, k) for t, k, _ in steps], options.floor_repeats)
    shape_cost = {(t, k): w for t, k, w in floor["floor_shape_s"]}
    result.update(floor, engine_over_floor=meter.wall_s / floor["floor_s"],
                  engine_cpu_over_floor_cpu=meter.cpu_s / floor["floor_cpu_s"],
                  # Step by step, so a neighbour's burst during a few steps (or during the floor) moves it little.
                  step_over_floor_median=median([s / shape_cost[(t, k)] for t, k, s in steps]))
    return result


def run_engine_compiled(source: str, workload: Workload, options: Options) -> dict[str, Any]:
    """The engine with `compile=True`: its compile and warm-up count in setup_s (and compile_s), not in wall_s."""
    return run_engine(source, workload, options, compile=True)


def make_engine(source: str, block_size: int | None = None, compile: bool | None = None):
    from paged_backend import Engine, EngineConfig
    from paged_backend.model.loading.model_loader import load_model

    model, tokenizer = load_model(source, dtype=torch.float32)
    # A small throwaway engine takes the warm-up request, so the measured one starts with clean stats.
    warm = Engine(model, tokenizer, EngineConfig(num_kv_blocks=4))
    warm.add_request(WARM_UP_PROMPT, engine_greedy(WARM_UP_TOKENS))
    while warm.has_unfinished_requests():
        warm.step()
    del warm
    config = EngineConfig(compile=compile) if block_size is None else EngineConfig(block_size=block_size,
                                                                                    compile=compile)
    return Engine(model, tokenizer, config)


def engine_greedy(max_tokens: int):
    from paged_backend import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def serve_engine(engine, workload: Workload, arrival_time: float) -> list:
    """Queue every request, step until all finish, return the final outputs in request order."""
    n = workload.num_requests
    for i in range(n):
        engine.add_request(workload.prompt_token_ids[i], engine_greedy(workload.max_tokens[i]), request_id=str(i),
                           stream=False, arrival_time=arrival_time)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    outs = [finals[str(i)] for i in range(n)]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"engine requests failed: {errors[:3]}")
    return outs


class StepRecorder:
    """An engine step observer noting (packed tokens, sampled rows, seconds) of every forward it runs."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []
        self.start = 0.0

    def before_forward(self, batch) -> None:
        self.start = time.perf_counter()

    def after_forward(self, batch, logits) -> None:
        self.steps.append((sum(batch.num_new_tokens), logits.shape[0], time.perf_counter() - self.start))


def record_steps(engine) -> list[tuple[int, int, float]]:
    """Observe the engine's steps; the returned list fills with (packed tokens, sampled rows, seconds) per forward."""
    recorder = StepRecorder()
    engine.observers.append(recorder)
    return recorder.steps


def measure_floor(model: torch.nn.Module, shapes: Sequence[tuple[int, int]], repeats: int) -> dict[str, Any]:
    """What the bare model needs for these packed forwards `[1, T]` (logits for the last k rows), with sdpa
    attention and no cache: the same work with no engine around it, in wall and process-CPU seconds.

    Each distinct shape is timed `repeats` times and its medians counted once per step that used it;
    medians keep a busy neighbour's burst from landing in the floor."""
    model.set_attn_implementation("sdpa")
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(SEED)
    cost: dict[tuple[int, int], tuple[float, float]] = {}
    with torch.inference_mode():
        model(input_ids=torch.tensor([WARM_UP_PROMPT]), use_cache=False)
        for t, k in sorted(set(shapes)):
            ids = torch.randint(vocab, (1, t), generator=generator)
            cost[(t, k)] = time_medians(lambda ids=ids, k=k: model(input_ids=ids, use_cache=False, logits_to_keep=k),
                                        repeats=repeats, warmup=0)
    return {
        "floor_s": sum(cost[s][0] for s in shapes),
        "floor_cpu_s": sum(cost[s][1] for s in shapes),
        "floor_shape_s": [[t, k, w] for (t, k), (w, _) in cost.items()],
    }


RUNNERS: dict[str, Callable[[str, Workload, Options], dict[str, Any]]] = {
    "sequential": run_sequential,
    "static": run_static,
    "hf_cb": run_hf_cb,
    "engine": run_engine,
    "engine_compiled": run_engine_compiled,
}


# ------------------------------------------------------------------ orchestration


def run_systems(workload: Workload, systems: Sequence[str], model_source: str, options: Options,
                isolate: bool = True, repeats: int = 1) -> dict[str, dict[str, Any]]:
    """Run each system on `workload`; with `isolate`, each in a fresh process (separate peak RSS).

    With `repeats` > 1 the systems take turns, round after round, and each keeps its fastest run:
    on a shared machine a neighbour's burst slows whichever system it lands on, never speeds one up."""
    unknown = [s for s in systems if s not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload.save(workload_path)
        for _ in range(repeats):
            for system in systems:
                if isolate:
                    run = run_worker_process(system, model_source, workload_path, Path(tmp), options)
                else:
                    run = RUNNERS[system](model_source, workload, options)
                runs[system].append(run)
    return {s: fastest(r) for s, r in runs.items()}


def run_worker_process(system: str, model_source: str, workload_path: Path, tmp: Path,
                       options: Options) -> dict[str, Any]:
    print(f"[throughput] running {LABELS[system]} ...", file=sys.stderr, flush=True)
    out = tmp / f"{system}.json"
    args = [str(Path(__file__).resolve()), "--worker", system, "--model", model_source,
            "--workload", str(workload_path), "--out", str(out), "--floor-repeats", str(options.floor_repeats)]
    if options.cb_num_blocks is not None:
        args += ["--cb-num-blocks", str(options.cb_num_blocks)]
    if options.block_size is not None:
        args += ["--block-size", str(options.block_size)]
    return run_json_subprocess(args, out)


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the least wall time, noting every run's wall time and the largest peak RSS of all."""
    best = dict(min(runs, key=lambda r: r["wall_s"]))
    best["wall_s_runs"] = [r["wall_s"] for r in runs]
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return best


def summarise(workload: Workload, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-system metrics, each system's tokens against HF `generate` one request at a time (when that
    system ran), the ratios and the targets."""
    reference = results.get(REFERENCE)
    systems = {}
    for name, r in results.items():
        summary = {
            "label": LABELS[name],
            "useful_tokens": workload.useful_tokens,
            "tokens_per_s": workload.useful_tokens / r["wall_s"],
            "wall_s": r["wall_s"],
            "ttft_first_s": r["ttft_s"][0],
            "ttft_median_s": median(r["ttft_s"]),
            "peak_rss_mb": r["peak_rss_mb"],
            "run_peak_rss_mb": r["run_peak_rss_mb"],
            "setup_s": r["setup_s"],
            # The one-at-a-time run is the reference itself: comparing it with itself would prove nothing.
            "tokens_equal_sequential": "reference" if name == REFERENCE else
            compare_tokens(r["tokens"], reference["tokens"]) if reference else None,
        }
        summary.update({k: v for k, v in r.items() if k not in summary and k not in ("tokens", "ttft_s")})
        systems[name] = summary
    report = {"systems": systems, "ratios": ratios(systems)}
    report["targets"] = check_targets(report)
    return report


def compare_tokens(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How many requests match the reference token for token, and where the first mismatch is."""
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b]
    first = None
    if mismatched:
        i = mismatched[0]
        position = next((j for j, (a, b) in enumerate(zip(tokens[i], reference[i])) if a != b),
                        min(len(tokens[i]), len(reference[i])))
        first = {"request": i, "position": position}
    return {"equal": len(reference) - len(mismatched), "of": len(reference), "first_mismatch": first}


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    engine = systems.get("engine")

    def versus(other: str) -> float | None:
        if engine is None or other not in systems:
            return None
        return engine["tokens_per_s"] / systems[other]["tokens_per_s"]

    compiled = systems.get("engine_compiled")
    return {"engine_vs_static": versus("static"), "engine_vs_hf_cb": versus("hf_cb"),
            "engine_vs_sequential": versus("sequential"),
            "compiled_vs_engine": (compiled["tokens_per_s"] / engine["tokens_per_s"]
                                   if compiled is not None and engine is not None else None)}


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for label, path, op, bound in TARGETS:
        value: Any = report
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        met = None if value is None else {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
        checks.append({"target": label, "value": value, "op": op, "bound": bound, "met": met})
    return checks


def format_report(report: dict[str, Any]) -> str:
    header = (f"{'system':34} {'tok/s':>8} {'wall s':>8} {'cpu s':>7} {'load':>5} {'TTFT 1st':>9} {'TTFT med':>9} "
              f"{'peak RSS':>9} {'KV util':>8} {'/floor':>7} {'= one-at-a-time':>16}")
    lines = [header]
    for s in report["systems"].values():
        eq = s["tokens_equal_sequential"]
        util, over = s.get("kv_utilisation_mean"), s.get("engine_over_floor")
        lines.append(
            f"{s['label']:34} {s['tokens_per_s']:8.1f} {s['wall_s']:8.1f} {s['cpu_s']:7.1f} "
            f"{fmt(s['load_1m_start'], '5.1f')} {s['ttft_first_s']:9.2f} "
            f"{s['ttft_median_s']:9.2f} {s['peak_rss_mb']:7.0f}MB {fmt(util, '8.1%')} {fmt(over, '7.2f')} "
            f"{format_equality(eq):>16}"
        )
    lines.append("(cpu s: this process's CPU seconds in the timed run; load: the machine's 1-minute load average as it "
                 "began; compare ratios only between runs under similar load)")
    engine = report["systems"].get("engine")
    if engine:
        lines.append(f"engine: {engine['num_steps']} steps, {engine['forward_s']:.1f} s of {engine['wall_s']:.1f} s "
                     f"inside model forwards; dense floor {engine['floor_s']:.1f} s wall, {engine['floor_cpu_s']:.1f} "
                     f"cpu-s; engine cpu-s / floor cpu-s {engine['engine_cpu_over_floor_cpu']:.2f}; median step / "
                     f"floor of its shape {engine['step_over_floor_median']:.2f}")
    lines.append("")
    for t in report["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"{t['target']:32} {fmt(t['value'], '8.2f')}   target {t['op']} {t['bound']:<6g} {verdict}")
    return "\n".join(lines)


def format_equality(eq: dict[str, Any] | str | None) -> str:
    if isinstance(eq, dict):
        return f"{eq['equal']}/{eq['of']}"
    return eq or "not run"


def fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".")[0].rstrip("%") or 0)
    return format(value, spec) if value is not None else "-".rjust(width)


# ------------------------------------------------------------------ command line


def default_workload(num_prompts: int, low: int, high: int, model_source: str) -> Workload:

    tokenizer = AutoTokenizer.from_pretrained(model_source)
    if tokenizer.chat_template is None:
        raise ValueError(f"{model_source}: the workload needs a tokenizer with a chat template")
    prompts = load_mt_bench_prompts(num_prompts)
    return chat_workload(tokenizer, prompts, draw_max_tokens(num_prompts, low, high, SEED))


def default_model_source() -> str:
    from paged_backend.model.loading.default_model import default_model_path

    return str(default_model_path())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=None, help="MT-bench prompts (default 32, or 8 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--quick", action="store_true", help="8 prompts, max_tokens 16..32")
    p.add_argument("--json", type=Path, default=None, help="results file (default benchmarks/results/throughput_<machine class>.json)")
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--cb-num-blocks", type=int, default=None,
                   help="transformers CB cache blocks (default: its own sizing, 60%% of free RAM)")
    p.add_argument("--block-size", type=int, default=None,
                   help="the engine's KV block size (default: EngineConfig's, 16); smaller blocks waste less")
    p.add_argument("--floor-repeats", type=int, default=3, help="timings per packed-forward shape for the floor")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per system, taking turns; each system reports its fastest (default 1)")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_worker(args: argparse.Namespace, options: Options) -> None:
    import json

    result = RUNNERS[args.worker](args.model, Workload.load(args.workload), options)
    args.out.write_text(json.dumps(result))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    options = Options(cb_num_blocks=args.cb_num_blocks, floor_repeats=args.floor_repeats, block_size=args.block_size)
    if args.worker:
        run_worker(args, options)
        return {}
    shape = dict(QUICK_WORKLOAD if args.quick else FULL_WORKLOAD)
    if args.num_prompts is not None:
        shape["num_prompts"] = args.num_prompts
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    model_source = args.model or default_model_source()
    workload = default_workload(shape["num_prompts"], shape["low"], shape["high"], model_source)
    info = machine_info()
    results = run_systems(workload, systems, model_source, options, repeats=args.repeats)
    report = summarise(workload, results)
    report["workload"] = {**shape, "seed": SEED, "repeats": args.repeats, "useful_tokens": workload.useful_tokens,
                          "prompt_tokens": sum(map(len, workload.prompt_token_ids)),
                          "max_tokens": workload.max_tokens, "model": model_source}
    report["machine"] = info
    report["command"] = " ".join(["python", "benchmarks/throughput.py", *(argv if argv is not None else sys.argv[1:])])
    print(format_report(report))
    path = write_results(report, 'throughput', args.json)
    print(f"\nresults: {path}; chart: {charts.draw('throughput', report, path)}")
    return report


if __name__ == "__main__":
    main()
