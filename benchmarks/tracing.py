"""What OpenTelemetry tracing costs the engine: the throughput workload with tracing off and on, in one process.

1. The throughput workload (benchmarks/throughput.py: 32 MT-bench prompts, 16..128 greedy tokens each) at
   the defaults, tracing off (no tracer provider) and on (an SDK provider whose batch processor hands every
   span to an exporter that counts and drops them, as a collector's client would send them), alternating,
   after one warm-up run each, `--repeats` rounds; the figure is the median over rounds of the on / off ratio
   within a round (less exposed to the machine's drift than a ratio of medians); on, spans are counted.
2. The off path alone: what a step of 32 untraced requests pays for tracing (`record_chunks` and
   `end_spans` over its requests and outputs), in microseconds, against the step's time.

    python benchmarks/tracing.py                 # 7 rounds each
    python benchmarks/tracing.py --repeats 3

Writes benchmarks/results/tracing_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` and `throughput` sit beside this script

from common import alternate, load_average, workload_runs, write_results
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from paged_backend import tracing

MODES = ("off", "on")


class CountingExporter(SpanExporter):
    """Drops the spans it is given, counting them."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans) -> SpanExportResult:
        self.count += len(spans)
        return SpanExportResult.SUCCESS


def engine_throughput(repeats: int) -> dict[str, Any]:
    """Tokens/s of the throughput workload, tracing off and on, in one process."""
    exporter = CountingExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    contexts = {"off": lambda: tracing.traced_by(None), "on": lambda: tracing.traced_by(provider)}
    runs, answers, prompts = workload_runs(contexts)
    for mode in MODES:  # warm-up: the exporter's thread started, the first spans' set-up paid
        runs[mode]()
    provider.force_flush()  # the warm-up's spans exported before the count starts
    exporter.count = 0
    figures = alternate(runs, repeats)
    provider.force_flush()
    # Each round ran both modes back to back: the ratio within a round is less exposed to the machine's drift.
    paired = [on / off for on, off in zip(figures["on"], figures["off"])]
    return {"prompts": prompts, "tokens_per_s": figures,
            "median_tokens_per_s": {mode: statistics.median(v) for mode, v in figures.items()},
            "median_round_ratio": statistics.median(paired), "round_ratios": paired,
            "spans_per_request": exporter.count / (repeats * prompts),
            "same_answers": answers["on"] == answers["off"]}


def off_path_us(requests: int = 32, repeats: int = 2000) -> float:
    """Microseconds a step of `requests` untraced decoding requests spends in tracing's two calls."""
    metrics = SimpleNamespace(timeline=None)
    reqs = [SimpleNamespace(metrics=metrics, output_token_ids=[1], num_computed_tokens=9, num_tokens=10)
            for _ in range(requests)]
    batch = SimpleNamespace(requests=reqs, num_new_tokens=[1] * requests)
    outputs = [SimpleNamespace(finished=False, metrics=metrics) for _ in range(requests)]

    def step() -> None:
        tracing.record_chunks(batch, 0.0, 1.0)
        tracing.end_spans(outputs)

    return min(timeit.repeat(step, number=repeats, repeat=5)) / repeats * 1e6


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    load_start = load_average()
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": args.repeats,
                               "off_path_us_per_32_request_step": off_path_us()}
    engine = results["engine"] = engine_throughput(args.repeats)
    rate = engine["median_tokens_per_s"]
    results["on_over_off"] = engine["median_round_ratio"]
    print(f"throughput workload: tracing off {rate['off']:.1f} tok/s, on {rate['on']:.1f} tok/s (medians); "
          f"on / off within a round, median {results['on_over_off']:.3f}x; {engine['spans_per_request']:.1f} spans "
          f"per request; same answers: {engine['same_answers']}")
    print(f"tracing off: {results['off_path_us_per_32_request_step']:.1f} us per 32-request step")
    results["load_1m_start"], results["load_1m_end"] = load_start, load_average()
    print(f"threads {results['threads']}; load average {load_start:.1f} -> {results['load_1m_end']:.1f}; "
          f"wrote {write_results(results, 'tracing', args.json)}")
    return results


if __name__ == "__main__":
    main()
