"""Bar charts of the comparison benchmarks, drawn from their results JSON into a PNG beside it.

Each comparison script calls its chart function after writing its JSON; this script redraws every
chart from the JSON files already in benchmarks/results/ (no re-measuring). matplotlib comes with the
optional `bench` extra (`pip install -e ".[bench]"`); without it the scripts skip the chart and say so.

    python benchmarks/charts.py                 # redraw every chart whose JSON exists
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def bar_chart(path: Path, title: str, labels: Sequence[str], values: Sequence[float], unit: str,
              note: str = "", highlight: int | None = None) -> Path | None:
    """Horizontal bars, one per system, each labelled with its value; returns the PNG's path, or None
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[charts] matplotlib is not installed (pip install -e '.[bench]'): no chart at {path}", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.6 * len(labels) + 1.6), dpi=110)
    colours = ["#4c78a8" if i != highlight else "#f58518" for i in range(len(labels))]
    y = list(range(len(labels)))[::-1]  # first system on top
    bars = ax.barh(y, values, color=colours)
    ax.set_yticks(y, labels)
    ax.bar_label(bars, [f"{v:,.1f}" for v in values], padding=3)
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(values) * 1.18)
    ax.set_title(title, fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7.5, color="#555555")
    fig.tight_layout(rect=(0, 0.06 if note else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def machine_note(machine: dict[str, Any] | None) -> str:
    if not machine:
        return ""
    load = machine.get("uptime") or f"load average {machine.get('load_average_1m', float('nan')):.1f}"
    return (f"{machine.get('cpu_count')} CPUs, {machine.get('torch_threads')} torch threads, {load}, "
            f"{machine.get('time_utc')}")


def throughput_chart(report: dict[str, Any], path: Path) -> Path | None:
    systems = report["systems"]
    names = [n for n in ("sequential", "static", "hf_cb", "engine") if n in systems]
    labels = [SHORT_LABELS.get(n, n) for n in names]
    workload = report.get("workload", {})
    return bar_chart(path, f"Output tokens/s, {workload.get('num_prompts', '')} MT-bench chats, greedy, EOS ignored",
                     labels, [systems[n]["tokens_per_s"] for n in names], "output tokens/s",
                     machine_note(report.get("machine")),
                     highlight=names.index("engine") if "engine" in names else None)


def prefix_cache_chart(report: dict[str, Any], path: Path) -> Path | None:
    off, on = report["off"], report["on"]
    unit = "output tokens/s (median of alternating runs)" if "wall_s_runs" in off else "output tokens/s (one run each)"
    return bar_chart(path, f"Prefix caching, {report['args']['num_requests']} requests sharing a "
                           f"{report['args']['system_tokens']}-token system prompt",
                     ["caching off", "caching on"], [off["output_tokens_per_s"], on["output_tokens_per_s"]],
                     unit, machine_note(report.get("machine")), highlight=1)


def pipeline_chart(report: dict[str, Any], path: Path) -> Path | None:
    return bar_chart(path, f"text-generation pipeline, {report['workload']['num_prompts']} chats x "
                           f"{report['workload']['max_new_tokens']} tokens",
                     [f"stock, batch_size={report['workload']['stock_batch_size']}", "paged"],
                     [report["stock"]["output_tokens_per_s"], report["paged"]["output_tokens_per_s"]],
                     "output tokens/s", machine_note(report.get("machine")), highlight=1)


def langchain_chart(report: dict[str, Any], path: Path) -> Path | None:
    return bar_chart(path, f"LangChain batch of {report['config']['questions']} chats, "
                           f"{report['config']['max_tokens']} tokens max",
                     ["ChatHuggingFace (HuggingFacePipeline)", "ChatPaged"],
                     [report["chat_huggingface"]["tokens_per_s"], report["chat_paged"]["tokens_per_s"]],
                     "output tokens/s (median of alternating runs)", machine_note(report.get("machine")), highlight=1)


SHORT_LABELS = {"sequential": "HF generate, one at a time", "static": "HF generate, static batches",
                "hf_cb": "transformers continuous batching", "engine": "paged-backend engine"}

CHARTS: dict[str, Callable[[dict[str, Any], Path], Path | None]] = {
    "throughput": throughput_chart,
    "prefix_cache": prefix_cache_chart,
    "pipeline": pipeline_chart,
    "langchain_batch": langchain_chart,
}


def draw(name: str, report: dict[str, Any], json_path: Path) -> Path | None:
    """The chart of benchmark `name` for `report`, written beside its JSON file."""
    return CHARTS[name](report, json_path.with_suffix(".png"))


def main() -> None:
    for name in CHARTS:
        json_path = RESULTS_DIR / f"{name}.json"
        if json_path.is_file():
            print(f"{name}: {draw(name, json.loads(json_path.read_text()), json_path)}")


if __name__ == "__main__":
    main()
