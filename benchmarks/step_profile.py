"""Where one engine step's time goes, at the defaults (the default model, compiled, int4, bf16 where the CPU
has it): a decode step of 32 sequences (MT-bench first turns, their prompts prefilled first) and a one-row decode
step, each profiled with torch's profiler over several steps.

    python benchmarks/step_profile.py                 # 32 sequences and 1, 8 steps each
    python benchmarks/step_profile.py --steps 16 --threads 2

A step's wall time is split into: the forward (of which the int4, int8 and dense matmuls, paged attention with its
cache writes and context reads, and the rest of the compiled graph: norms, rotary, activations, fused elementwise
kernels), and the sampling and host work around it (scheduling, packing the step's inputs, output processing), by
share. The forward is marked by a step observer (engine.observers), the engine's own parts left as they are.
Writes benchmarks/results/step_profile_<machine class>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import chat_workload, load_mt_bench_prompts, machine_info, write_results  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402

# Profiler op names (substrings) -> the part of the forward they are. The first match wins.
CATEGORIES = (
    ("int4 matmul", ("_weight_int4pack_mm", "int4mm", "paged_backend::int4_matmul")),
    ("int8 matmul", ("_weight_int8pack_mm", "int8_matmul")),
    ("paged attention (with cache writes and context reads)", ("paged_backend::paged_attention",
                                                               "paged_backend::latent_attention", "scaled_dot_product")),
    ("dense matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
)
FORWARD = "## forward"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled per batch size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM()
    engine = llm.engine
    engine.observers.append(ForwardMarker())
    prompts = chat_workload(llm.tokenizer, load_mt_bench_prompts(args.num_seqs), [10_000] * args.num_seqs)
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (LLM() defaults)", "threads": args.threads,
                              "compiled": engine.runner.compiled, "dtype": str(next(engine.model.parameters()).dtype),
                              "machine": machine_info()}
    for rows in (args.num_seqs, 1):
        result[f"decode_{rows}"] = profile_decode(engine, prompts.prompt_token_ids[:rows], args.steps)
        print(f"decode step of {rows} sequence(s): {describe(result[f'decode_{rows}'])}", flush=True)
    print(f"wrote {write_results(result, 'step_profile', args.json)}")


class ForwardMarker:
    """A step observer that marks each forward in the profile (a record_function opened before, closed after)."""

    def __init__(self) -> None:
        self.open = None

    def before_forward(self, batch) -> None:
        self.open = torch.profiler.record_function(FORWARD)
        self.open.__enter__()

    def after_forward(self, batch, logits) -> None:
        self.open.__exit__(None, None, None)


def profile_decode(engine, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Prefill `prompts` (unprofiled), then profile `steps` steps in which every sequence decodes one token."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running):
        engine.step()
    engine.step()  # the first all-decode step: allocations settle
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return shares(prof, walls, len(prompts))


def shares(prof, walls: list[float], rows: int) -> dict[str, Any]:
    """Each part's share of the steps' wall time. Every profiled op's self time goes to the first of CATEGORIES
    that it or an op it runs inside matches (the gathers and casts inside paged attention are attention's), and
    what no category takes inside the forward is the rest of the compiled graph."""
    total_wall_us = sum(walls) * 1e6
    parts: dict[str, float] = defaultdict(float)
    for event in prof.events():
        part = category_of(event) if event.name != FORWARD else None
        if part is not None:
            parts[part] += event.self_cpu_time_total
    events = prof.key_averages()
    forward_us = next((e.cpu_time_total for e in events if e.key == FORWARD), 0.0)
    rest_of_forward = max(0.0, forward_us - sum(parts.values()))
    host = max(0.0, total_wall_us - forward_us)
    table = {**{name: us / total_wall_us for name, us in parts.items()},
             "rest of the forward (compiled graph: norms, rotary, activations, ...)": rest_of_forward / total_wall_us,
             "sampling and host work (scheduling, input packing, output processing)": host / total_wall_us}
    return {"rows": rows, "steps": len(walls), "step_ms_median": round(statistics.median(walls) * 1e3, 2),
            "forward_ms_per_step": round(forward_us / len(walls) / 1e3, 2),
            "shares": {name: round(share, 3) for name, share in sorted(table.items(), key=lambda kv: -kv[1])},
            "top_ops_ms_per_step": [(e.key, round(e.self_cpu_time_total / len(walls) / 1e3, 3))
                                    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]]}


def category_of(event) -> str | None:
    """The category of the outermost op, among `event` and those it runs inside, that matches one; None when
    none does or the op lies outside the forward."""
    found, node, inside_forward = None, event, False
    while node is not None:
        if node.name == FORWARD:
            inside_forward = True
        for name, needles in CATEGORIES:
            if any(needle in node.name for needle in needles):
                found = name
                break
        node = node.cpu_parent
    return found if inside_forward else None


def describe(part: dict[str, Any]) -> str:
    shares_text = ", ".join(f"{name} {share:.0%}" for name, share in part["shares"].items())
    return f"median step {part['step_ms_median']} ms (forward {part['forward_ms_per_step']} ms): {shares_text}"


if __name__ == "__main__":
    main()
