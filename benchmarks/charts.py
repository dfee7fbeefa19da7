"""Charts and result tables of the benchmarks, drawn from the current results files (no re-measuring).

`python benchmarks/charts.py` reads every `benchmarks/results/<benchmark>_<machine class>.json` and writes
- the charts, as PNGs in docs/assets/benchmarks/ (matplotlib, the optional `bench` extra),
- the generated results section of docs/benchmarks.md (every figure with the command and the provenance
  of the file it comes from),
- the generated results section of README.md (the headline chart and table).
`python benchmarks/charts.py --check` changes nothing and fails when a generated section is stale.
Each comparison script also draws its own chart beside its JSON right after a run (`draw`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
CHARTS_DIR = ROOT / "docs" / "assets" / "benchmarks"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "tools"))

import generated_sections


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


def machine_note(report: dict[str, Any]) -> str:
    """The chart's footnote: where and when the figures were measured."""
    machine = report.get("machine") or {}
    provenance = report.get("provenance") or {}
    load = machine.get("load_average_1m")
    parts = [f"machine class {provenance['machine_class']}" if provenance else None,
             f"{machine['cpu_count']} CPUs" if machine.get("cpu_count") else None,
             f"{machine['torch_threads']} torch threads" if machine.get("torch_threads") else None,
             f"load average {load:.1f}" if load is not None else None,
             machine.get("time_utc") or provenance.get("written_utc")]
    return ", ".join(p for p in parts if p)


def throughput_chart(report: dict[str, Any], path: Path) -> Path | None:
    systems = report["systems"]
    names = [n for n in ("sequential", "static", "hf_cb", "engine", "engine_compiled") if n in systems]
    labels = [SHORT_LABELS.get(n, n) for n in names]
    workload = report.get("workload", {})
    return bar_chart(path, f"Output tokens/s, {workload.get('num_prompts', '')} MT-bench chats, greedy, EOS ignored",
                     labels, [systems[n]["tokens_per_s"] for n in names], "output tokens/s",
                     machine_note(report),
                     highlight=names.index("engine") if "engine" in names else None)


def prefix_cache_chart(report: dict[str, Any], path: Path) -> Path | None:
    off, on = report["off"], report["on"]
    unit = "output tokens/s (median of alternating runs)" if "wall_s_runs" in off else "output tokens/s (one run each)"
    return bar_chart(path, f"Prefix caching, {report['args']['num_requests']} requests sharing a "
                           f"{report['args']['system_tokens']}-token system prompt",
                     ["caching off", "caching on"], [off["output_tokens_per_s"], on["output_tokens_per_s"]],
                     unit, machine_note(report), highlight=1)


def pipeline_chart(report: dict[str, Any], path: Path) -> Path | None:
    return bar_chart(path, f"text-generation pipeline, {report['workload']['num_prompts']} chats x "
                           f"{report['workload']['max_new_tokens']} tokens",
                     [f"stock, batch_size={report['workload']['stock_batch_size']}", "paged"],
                     [report["stock"]["output_tokens_per_s"], report["paged"]["output_tokens_per_s"]],
                     "output tokens/s", machine_note(report), highlight=1)


def langchain_chart(report: dict[str, Any], path: Path) -> Path | None:
    return bar_chart(path, f"LangChain batch of {report['config']['questions']} chats, "
                           f"{report['config']['max_tokens']} tokens max",
                     ["ChatHuggingFace (HuggingFacePipeline)", "ChatPaged"],
                     [report["chat_huggingface"]["tokens_per_s"], report["chat_paged"]["tokens_per_s"]],
                     "output tokens/s (median of alternating runs)", machine_note(report), highlight=1)


SHORT_LABELS = {"sequential": "HF generate, one at a time", "static": "HF generate, static batches",
                "hf_cb": "transformers continuous batching", "engine": "paged-backend engine",
                "engine_compiled": "paged-backend engine, compile=True"}

CHARTS: dict[str, Callable[[dict[str, Any], Path], Path | None]] = {
    "throughput": throughput_chart,
    "prefix_cache": prefix_cache_chart,
    "pipeline": pipeline_chart,
    "langchain_batch": langchain_chart,
}


def draw(name: str, report: dict[str, Any], json_path: Path, out: Path | None = None) -> Path | None:
    """The chart of benchmark `name` for `report`, written to `out` or beside its JSON file."""
    return CHARTS[name](report, out or json_path.with_suffix(".png"))


# ------------------------------------------------------------------ the current results files


def current_results() -> list[tuple[str, str, dict[str, Any]]]:
    """(benchmark, machine class, record) of every results file, by benchmark then machine class."""
    found = []
    for path in sorted(RESULTS_DIR.glob("*.json")):
        benchmark, _, machine = path.stem.rpartition("_")
        found.append((benchmark, machine, json.loads(path.read_text())))
    return found


def number(value: float, digits: int = 1) -> str:
    return f"{value:.{digits}f}"


def throughput_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for s in r["systems"].values():
        equal = s.get("tokens_equal_sequential")
        same = "" if not isinstance(equal, dict) else f", tokens equal to one-at-a-time {equal['equal']}/{equal['of']}"
        rows.append((s["label"], (f"{number(s['tokens_per_s'])} output tok/s, wall {number(s['wall_s'])} s, "
                                 f"first token {number(s['ttft_first_s'], 2)} s, peak RSS {s['peak_rss_mb']:.0f} MB{same}")))
    rows += [(f"ratio {name}", f"{number(v, 2)}x") for name, v in r["ratios"].items() if v is not None]
    engine = r["systems"].get("engine", {})
    if engine.get("kv_utilisation_mean") is not None:
        rows.append(("engine KV-cache utilisation (mean)", number(engine["kv_utilisation_mean"], 3)))
    return rows


def prefix_cache_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    off, on = r["off"], r["on"]
    return [("caching off", f"{number(off['output_tokens_per_s'])} output tok/s, {off['prefill_tokens_computed']} prefill tokens computed"),
            ("caching on", (f"{number(on['output_tokens_per_s'])} output tok/s, {on['prefill_tokens_computed']} prefill tokens "
                           f"computed, hit rate {number(on['hit_rate'], 2)}")),
            ("ratio", f"{number(r['ratio'], 2)}x, same tokens: {r['same_tokens']}")]


def pipeline_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [("stock pipeline, batch_size " + str(r["workload"]["stock_batch_size"]), f"{number(r['stock']['output_tokens_per_s'])} output tok/s"),
            ("PagedTextGenerationPipeline", f"{number(r['paged']['output_tokens_per_s'])} output tok/s"),
            ("ratio", f"{number(r['throughput_ratio'], 2)}x, identical outputs {r['identical_outputs']}")]


def serve_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for row in r["results"]:
        ms = {k: {q: row[k][q] * 1000 for q in ("mean", "median", "p99")} for k in ("ttft_s", "tpot_s", "itl_s")}
        rows.append((f"request rate {row['rate']}/s",
                     (f"{row['completed']} done, {number(row['requests_per_s'], 2)} req/s, {number(row['output_tokens_per_s'])} "
                     f"output tok/s; TTFT mean/median/p99 {ms['ttft_s']['mean']:.0f}/{ms['ttft_s']['median']:.0f}/"
                     f"{ms['ttft_s']['p99']:.0f} ms; TPOT {ms['tpot_s']['mean']:.0f}/{ms['tpot_s']['median']:.0f}/"
                     f"{ms['tpot_s']['p99']:.0f} ms")))
    return rows


def replicas_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(e["label"], f"{number(e['tokens_per_s'])} output tok/s") for e in r["one_engine"]]
    rows.append((r["replicas"]["label"], f"{number(r['replicas']['tokens_per_s'])} output tok/s"))
    rows.append(("replicas over the best single engine", (f"{number(r['replicas_over_best_one_engine'], 2)}x, tokens equal "
                                                         f"{r['tokens_equal']}")))
    return rows


def self_check_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [("load-time self-check (median)", f"{number(r['self_check_median_ms'])} ms"),
            ("one plain 8-token forward (median)", f"{number(r['plain_8_token_forward_median_ms'])} ms"),
            ("engine start without the check (median)", f"{number(r['engine_start_without_check_median_ms'])} ms"),
            *fast_path_check_figures(r)]


def fast_path_check_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The compiled forward's start-up check at the defaults, where the results file has it."""
    if "fast_path_check_median_ms" not in r:
        return []
    return [("compiled-forward check at the defaults (median)", f"{number(r['fast_path_check_median_ms'])} ms, "
             f"largest KL {number(r['fast_path_check_max_kl'])} (bound {number(r['fast_path_check_kl_bound'])})"),
            ("warm default start in a new process (median)", f"{number(r['warm_start_median_ms'])} ms"),
            ("the check's share of that start", f"{100 * r['fast_path_check_share_of_warm_start']:.1f} %")]


def structured_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    tps = r["output_tokens_per_s"]
    return [("constrained", f"{number(tps['constrained'])} output tok/s, {r['valid']} of {r['num_answers']} valid"),
            ("unconstrained", f"{number(tps['unconstrained'])} output tok/s"),
            ("ratio", f"{number(r['ratio'], 2)}x")]


def stats_scrape_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [("stats() idle", f"{number(r['stats_idle_ms'], 2)} ms"), ("stats() during a batch (median)", f"{number(r['stats_busy_ms'])} ms"),
            ("generation with a thread scraping / without", f"{number(r['ratio'], 2)}x")]


def speculative_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for workload in ("single_stream", "concurrent_grounded", "concurrent_mt_bench"):
        w = r.get(workload)
        if not w:
            continue
        for variant in r.get("variants", {"spec": {}}):
            v = w[variant]
            rows.append((f"{workload} ({variant})", (f"{number(w['plain_tokens_per_s'], 2)} -> {number(v['tokens_per_s'], 2)} tok/s, "
                                                    f"{number(v['ratio'], 3)}x, acceptance {number(v['acceptance_rate'], 3)}, "
                                                    f"identical outputs: {w['outputs_identical']}")))
    return rows


def lora_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    tps, ratios = r["output_tokens_per_s"], r["ratios"]
    return [("engine, each request with its adapter", f"{number(tps['engine_lora'])} output tok/s"),
            ("same engine, no adapters", f"{number(tps['engine_base'])} output tok/s"),
            ("PEFT, set_adapter + static batches", f"{number(tps['peft_sequential'])} output tok/s"),
            ("LoRA / no LoRA", f"{number(ratios['lora_vs_base'], 2)}x"),
            ("engine / PEFT", (f"{number(ratios['lora_vs_peft_sequential'], 2)}x, {r['identical_to_peft']} of "
                              f"{r['workload']['requests']} answers identical to PEFT's"))]


def quality_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name, v in r["variants"].items():
        speed = f", one stream {number(v['tokens_per_s'])} tok/s" if "tokens_per_s" in v else ""
        rows.append((name, (f"mean absolute logprob difference {number(v['mean_abs_dlogprob'], 3)}, teacher-forced top token equal "
                           f"{number(v['teacher_forced_agreement'], 3)}, free-running equal {number(v['agreement'], 3)}{speed}")))
    return rows


def cpu_vs_llamacpp_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    m = r["medians"]
    rows = [("engine one stream (median)", f"{number(m['engine_one_stream'])} tok/s"),
            ("llama.cpp one stream (median)", f"{number(m['llamacpp_one_stream'])} tok/s")]
    if "engine_throughput" in m:
        rows.append(("engine, throughput workload (median)", f"{number(m['engine_throughput'])} tok/s"))
    rows.append(("engine weights", f"{r['engine_dtype']}, int4: {r['engine_int4_weights']}"))
    for name, value in r.get("ratios", {}).items():
        rows.append((f"ratio: {name.replace('_', ' ')}", f"{number(value, 2)}x"))
    if "llama_cpp_extra_buffers" in r:
        rows.append(("llama.cpp extra buffer types (repacking, AMX)", "on" if r["llama_cpp_extra_buffers"] else "off"))
    return rows


def sliding_window_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    keep, free = r["settings"]["keep_every_block"], r["settings"]["free_window_blocks"]
    need = r["kv_bytes_per_sequence_ratio_to_need"]
    return [("requests running at once on one KV budget", f"{keep['most_requests_running']} -> {free['most_requests_running']} "
                                                          f"({number(r['sequences_held_ratio'], 2)}x)"),
            (f"KV of one sequence at {r['context']} tokens / what its window needs",
             f"{number(need['keep_every_block'], 2)}x -> {number(need['free_window_blocks'], 2)}x"),
            ("same tokens", str(r["outputs_identical"]))]


def startup_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(mode.replace("_", " ") + " start (process, median)", f"{number(r[mode]['median_process_s'])} s")
            for mode in ("eager", "cold_compiled", "warm_compiled")]
    return rows + [("warm compiled start minus eager start", f"{number(r['warm_minus_eager_s'])} s"),
                   ("warm starts loaded every graph", str(r["warm_loaded_every_graph"]))]


def fused_projections_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(f"{mode}: one stream, fused / unfused projections (medians)",
             f"{number(m['fused'])} / {number(m['unfused'])} tok/s, ratio {number(m['ratio'], 2)}x (median of "
             f"{r['repeats']} per-run ratios)") for mode, m in r["medians"].items()]
    return rows + [("same tokens fused and unfused", ", ".join(f"{mode}: {same}" for mode, same in r["same_tokens"].items())),
                   ("weights", f"{r['dtype']}, int4: {r['int4_weights']}; {r['tokens']} tokens per run")]


def gpu_check_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    steps = r.get("steps", {})
    if "variants" not in steps:
        return [("steps", f"failed: {steps.get('error', 'not run')}")]
    rows = [(f"{name} steps", f"{number(v['tokens_per_s'])} tok/s, decode step {v['decode_step_ms'][1]} ms at batch "
                              f"{v['decode_step_ms'][0]}" + (f", tokens equal to eager: {v['tokens_equal_eager']['equal']} of "
                                                            f"{v['tokens_equal_eager']['of']}" if "tokens_equal_eager" in v else ""))
            for name, v in steps["variants"].items()]
    return rows + [("passed", str(steps["ok"]))]


def hybrid_decode_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"{family}: engine vs HF generate, {r['requests']} requests x {r['tokens']} tokens",
             f"{number(f['engine_median'])} vs {number(f['hf_generate_median'])} tok/s ({number(f['ratio'], 2)}x), "
             f"identical answers {f['identical_answers']} of {r['requests']}")
            for family, f in r["families"].items()]


def step_profile_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key in ("decode_32", "decode_1"):
        part = r.get(key)
        if part is None:
            continue
        shares = ", ".join(f"{name} {100 * share:.0f} %" for name, share in part["shares"].items())
        rows.append((f"decode step of {part['rows']} sequence(s), {part['steps']} steps",
                     f"{number(part['step_ms_median'])} ms median: {shares}"))
    return rows


def cpu_attention_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    call = r["one_layer_call"]
    us = call["median_us"]
    rows = [(f"one layer's attention, {call['seqs']} decode rows over {call['keys']} keys (bf16): kernel vs PyTorch ops",
             f"{number(us['kernel'])} vs {number(us['torch_ops'])} us ({number(us['torch_ops'] / us['kernel'], 2)}x)")]
    if "engine" in r:
        engine = r["engine"]
        rate = engine["median_tokens_per_s"]
        rows.append(("throughput workload at the defaults: kernel vs PyTorch ops (one process, alternating)",
                     f"{number(rate['kernel'])} vs {number(rate['torch_ops'])} tok/s "
                     f"({number(rate['kernel'] / rate['torch_ops'], 2)}x)"))
        rows.append(("answers token for token the same both ways", f"{engine['identical_answers']} of {engine['prompts']}"))
    for call in r.get("prompt_calls", []):
        us = call["median_us"]
        rows.append((f"one layer's attention, {call['prompts']} fresh prompts of {call['length']} tokens (bf16): "
                     "kernel vs SDPA", f"{number(us['kernel'])} vs {number(us['sdpa'])} us ({number(call['speedup'], 2)}x)"))
    if "engine_prompts" in r:
        rate = r["engine_prompts"]["median_tokens_per_s"]
        rows.append(("throughput workload, its prompts attended by the kernel vs by SDPA (one process, alternating)",
                     f"{number(rate['kernel'])} vs {number(rate['sdpa'])} tok/s "
                     f"({number(rate['kernel'] / rate['sdpa'], 2)}x)"))
    return rows


def cpu_int8_head_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    us = r["one_call"]["median_us"]
    rate = r["one_stream"]["median_tokens_per_s"]
    same = r["one_stream"]["first_difference"]
    return [("the default model's int8 LM head at one row, its codes from memory: kernel vs torch's int8 kernel",
             f"{number(us['kernel'])} vs {number(us['torch'])} us ({number(us['torch'] / us['kernel'], 2)}x)"),
            (f"one stream of {r['one_stream']['tokens']} greedy tokens at the defaults: kernel vs torch's kernel "
             "(one process, alternating)",
             f"{number(rate['kernel'])} vs {number(rate['torch'])} tok/s ({number(rate['kernel'] / rate['torch'], 2)}x); "
             + ("the same tokens" if same is None else f"tokens part at position {same}"))]


def quantized_checkpoints_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    s, ratios, files = r["summary"], r["ratios_over_int4"], r["file_mib"]
    heads = r.get("lm_head", {})
    names = {"gptq": f"GPTQ 4-bit, groups of {r['group_size']} (fp16 LM head"
                     + (f": {heads['gptq']})" if "gptq" in heads else ")"),
             "gptq-fp32-head": "the same with its LM head widened to fp32, as before the fp16 head kernel",
             "gptq-int8-head": "the same with its LM head made int8, as the int4 path's is",
             "gptq-8bit": f"GPTQ 8-bit, groups of {r['group_size']} (`DequantizingLinear`)",
             "fp8": "compressed-tensors FP8, a scale per row (`DequantizingLinear`)"}
    rows = [(f"one stream of {r['tokens']} greedy tokens, default model's shape: {label} vs the int4 path",
             f"{number(s[side]['tok_s'])} vs {number(s['int4']['tok_s'])} tok/s ({number(ratios[side], 2)}x)")
            for side, label in names.items() if side in s]
    for side in files:
        rows.append((f"{side}: memory beyond the process before loading, resident after loading / peak while loading",
                     f"{number(s[side]['loaded_mib'])} / {number(s[side]['peak_loading_mib'])} MiB for "
                     f"{number(files[side])} MiB of files"))
    rows.append(("int4 path: the same", f"{number(s['int4']['loaded_mib'])} / {number(s['int4']['peak_loading_mib'])} MiB"))
    return rows


def cpu_int4_batch_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    def dense(ms: dict[str, float]) -> str:  # the dense copy's name: "dense bf16", or "dense float32" on AVX2
        return next(name for name in ms if name.startswith("dense"))

    rows = [(f"the default model's 120 int4 projections at {count} row(s): kernel / torch's int4 kernel / "
             f"{dense(ms)} (ms)",
             f"{number(ms['kernel'])} / {number(ms['torch int4'])} / {number(ms[dense(ms)])} "
             f"({number(ms['torch int4'] / ms['kernel'], 2)}x torch's)")
            for count, ms in r["matmul_ms_per_pass"].items()]
    for figure, label in (("throughput", "throughput workload"), ("one_stream", "one stream")):
        if figure in r.get("engine", {}):
            rate = r["engine"][figure]["median_tokens_per_s"]
            rows.append((f"{label} at the defaults: the kernel vs torch's int4 kernel (one process, alternating)",
                         f"{number(rate['kernel'])} vs {number(rate['torch'])} tok/s "
                         f"({number(rate['kernel'] / rate['torch'], 2)}x); answers equal "
                         f"{r['engine'][figure]['answers_equal']}"))
    return rows


def tracing_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rate = r["engine"]["median_tokens_per_s"]
    return [("throughput workload at the defaults: tracing on (every span exported) vs off (one process, alternating; "
             "the ratio is the median of the rounds' on / off)",
             f"{number(rate['on'])} vs {number(rate['off'])} tok/s (medians; {number(r['on_over_off'], 3)}x), "
             f"{number(r['engine']['spans_per_request'])} spans per request, same answers {r['engine']['same_answers']}"),
            ("tracing off: what a 32-request step pays for it", f"{number(r['off_path_us_per_32_request_step'])} us")]


def cpu_peers_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    medians, rows = r["medians"], []
    for figure, label in (("throughput", f"throughput, {r['workload']['chats']} chats at once"),
                          ("one_stream", f"one stream, {r['tokens']} tokens incl. the prompt")):
        values = ", ".join(f"{system} {number(m[figure])}" for system, m in medians.items() if figure in m)
        rows.append((f"{label} (tok/s, medians of {r['rounds']} rounds)", values))
    if "llama_bench_tg" in medians.get("llama.cpp", {}):
        rows.append(("llama.cpp decode only (llama-bench tg128, tok/s)", number(medians["llama.cpp"]["llama_bench_tg"])))
    for pair, ratios in r["ratios"].items():
        rows.append((pair, f"throughput {number(ratios['throughput'], 2)}x, one stream {number(ratios['one_stream'], 2)}x"))
    return rows


def kv_offload_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    warm, swap = r["restart"], r["preemption"]
    per_block_ms = 1000 * warm["restore_s"] / max(warm["disk_hit_blocks"], 1)
    rows = [(f"first token of a {warm['prompt_tokens']}-token prompt after a restart, its prefix read back from disk "
             f"(medians of {len(warm['warm_s'])})", f"{number(warm['warm_median_s'], 3)} s"),
            ("the same, its files first dropped from the page cache (read from the device)",
             f"{number(warm['warm_from_disk_median_s'], 3)} s"),
            ("the same prompt computed cold by an engine without the tier", f"{number(warm['cold_median_s'], 3)} s"),
            ("warm / cold, warm from the device / cold",
             f"{number(warm['ratio'], 3)}, {number(warm['ratio_from_disk'], 3)} (target <= 0.2)"),
            ("tokens read back per warm request", str(warm["warm_cached_tokens"][0])),
            ("reading one block back from disk (restore seconds / blocks)", f"{number(per_block_ms, 2)} ms"),
            ("same greedy tokens warm and cold", str(warm["same_tokens"]))]
    medians, computed = swap["median_s"], swap["computed_tokens"]
    rows += [(f"{swap['requests']} requests preempting in {swap['num_kv_blocks']} blocks ({swap['dtype']}): wall time, "
              "medians", f"recompute {number(medians['recompute'], 1)} s, swap to disk {number(medians['swap_disk'], 1)} s "
                         f"({number(swap['ratio'], 3)}x)"),
             ("preemptions per run", f"recompute {swap['preemptions']['recompute']}, swap {swap['preemptions']['swap_disk']}"),
             ("tokens computed per run", f"recompute {computed['recompute']}, swap {computed['swap_disk']}"),
             ("blocks swapped in, all runs", str(swap["swapped_in_blocks"]))]
    rows.append(("same tokens, swap and recompute", f"{swap['same_tokens']} ({swap['requests_with_same_tokens']} of "
                                                    f"{swap['requests']} requests)"))
    return rows


def rl_rollouts_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    w, memory = r["workload"], r["memory"]
    rows = [(f"{w['rows']} sampled rollouts ({w['prompts']} prompts x {w['generations']}), up to {w['max_new_tokens']} "
             f"new tokens, {w['dtype']}: generated tok/s, medians of {w['rounds']} rounds",
             ", ".join(f"{system} {number(s['tokens_per_s'])}" for system, s in r["systems"].items()))]
    rows += [(name, f"{number(value, 2)}x") for name, value in r["ratios"].items()]
    if "kv_pool_bytes" in memory:
        rows.append(("weights (one copy: the engine runs the model object) / the engine's KV pool",
                     f"{number(memory['weight_bytes_after_engine'] / 2**20)} / {number(memory['kv_pool_bytes'] / 2**20)} MiB, "
                     f"engine.model is model: {memory['engine_runs_the_model_object']}"))
    return rows


def batch_invariant_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name, system in r["systems"].items():
        drift = system["alone_vs_batched_max_abs_logprob"]
        rows.append((f"{name}: tok/s of {r['args']['chats']} chats / of one stream; a chat's logprobs alone vs "
                     "batched / vs the dense forward (max abs)",
                     f"{number(system['batch_tok_s'])} / {number(system['stream_tok_s'])}; "
                     f"{'tokens differ' if drift is None else f'{drift:.1e}'} / "
                     f"{system['vs_dense_forward_max_abs_logprob']:.1e}"))
    rows += [(name, f"{number(value, 2)}x") for name, value in r["ratios"].items()]
    return rows


def vision_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    w, results = r["workload"], r["results"]
    rows = [(f"{w['num_requests']} requests, one image each ({w['image_tokens']} image tokens), {w['max_tokens']} "
             f"greedy tokens, {w['model']}: output tok/s, medians of {w['repeats']} runs",
             ", ".join(f"{name} {number(result['output_tokens_per_s'])}" for name, result in results.items()))]
    rows += [(name, f"{number(value, 2)}x") for name, value in r["ratios"].items()]
    for name in ("engine_fresh_images", "engine_repeated_images"):
        counted = results[name]["counted"]
        rows.append((f"{name}: images encoded / encoder cache hits / prefix-cache hit tokens",
                     f"{counted['images_encoded']} / {counted['encoder_cache_hits']} / "
                     f"{counted['prefix_cache_hit_tokens']}"))
    rows.append(("the engine's greedy tokens equal HF generate's", str(r["tokens_equal_hf"])))
    return rows


def sampler_figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for kind, result in r["results"].items():
        rows.append((f"{r['rows']} {kind} rows of {r['vocab']} at temperature {r['temperature']}: ms per draw, medians "
                     f"of {r['repeats']}", ", ".join(f"{name} {number(ms, 2)}" for name, ms in result["ms"].items())))
        rows += [(f"{kind}: {name}", f"{number(value, 2)}x") for name, value in result.items() if name != "ms"]
    return rows


FIGURES: dict[str, Callable[[dict[str, Any]], list[tuple[str, str]]]] = {
    "throughput": throughput_figures, "prefix_cache": prefix_cache_figures, "pipeline": pipeline_figures,
    "serve": serve_figures, "replicas": replicas_figures, "self_check": self_check_figures,
    "structured": structured_figures, "stats_scrape": stats_scrape_figures, "speculative": speculative_figures,
    "lora": lora_figures, "quality": quality_figures, "cpu_vs_llamacpp": cpu_vs_llamacpp_figures,
    "sliding_window_memory": sliding_window_figures, "startup": startup_figures, "gpu_check": gpu_check_figures,
    "fused_projections": fused_projections_figures, "hybrid_decode": hybrid_decode_figures,
    "step_profile": step_profile_figures, "cpu_attention": cpu_attention_figures,
    "cpu_int8_head": cpu_int8_head_figures, "tracing": tracing_figures, "cpu_peers": cpu_peers_figures,
    "cpu_int4_batch": cpu_int4_batch_figures, "quantized_checkpoints": quantized_checkpoints_figures,
    "kv_offload": kv_offload_figures, "rl_rollouts": rl_rollouts_figures, "batch_invariant": batch_invariant_figures,
    "vision": vision_figures, "sampler": sampler_figures,
}


def provenance_lines(p: dict[str, Any]) -> list[str]:
    commit = p.get("git_commit")
    code = (f"commit `{commit[:10]}`" + (" (with uncommitted changes)" if p.get("git_dirty") else "")
            if commit else f"not recorded; the file was added in commit `{p['added_in_commit'][:10]}`")
    flags = p.get("cpu_flags")
    shown = ", ".join(f for f, on in flags.items() if on) if flags else None
    loads = [p.get("load_average_before"), p.get("load_average_after")]
    load = " -> ".join(number(x[0]) if x else "?" for x in loads) if any(loads) else "not recorded"
    return [f"- command: `{p['command']}`",
            f"- code: {code}",
            f"- machine: {p.get('machine_note') or p.get('cpu_model') or 'not recorded'}"
            + (f"; flags {shown}" if shown else "") + (f"; GPU {p['gpu']}" if p.get("gpu") else ""),
            (f"- torch threads {p.get('torch_threads') or 'not recorded'}; torch {p.get('torch') or 'not recorded'}, "
            f"transformers {p.get('transformers') or 'not recorded'}; 1-minute load average {load}"),
            f"- date: {p.get('written_utc') or p.get('added_utc') or 'not recorded'} ({p['provenance']})"]


def benchmarks_section() -> str:
    """docs/benchmarks.md's results: per file, its figures and where they came from."""
    out = []
    for benchmark, machine, record in current_results():
        out.append(f"### {benchmark}, machine class `{machine}`\n")
        chart = CHARTS_DIR / f"{benchmark}_{machine}.png"
        if chart.is_file():
            out.append(f"![{benchmark} on {machine}](assets/benchmarks/{chart.name})\n")
        out.append("| figure | value |\n|---|---|")
        out += [f"| {label} | {value} |" for label, value in FIGURES[benchmark](record)]
        out.append(f"\nFrom `benchmarks/results/{benchmark}_{machine}.json`:\n")
        out += provenance_lines(record["provenance"])
        out.append("")
    return "\n".join(out)


# The README's headline: (benchmark, machine class, what was measured, the figure); both are formatted from
# the record, so every number the README shows is one of its results file's.
def cpu_int4_batch_headline(r: dict[str, Any]) -> str:
    rate = r["engine"]["throughput"]["median_tokens_per_s"]
    return f"{number(rate['kernel'] / rate['torch'], 2)}x ({number(rate['kernel'])} vs {number(rate['torch'])} tok/s)"


def cpu_peers_headline(r: dict[str, Any]) -> str:
    return (f"{number(r['ratios']['paged-backend / vLLM CPU']['throughput'], 2)}x "
            f"({number(r['medians']['paged-backend']['throughput'])} vs "
            f"{number(r['medians']['vLLM CPU']['throughput'])} tok/s); "
            f"{number(r['ratios']['paged-backend / llama.cpp']['one_stream'], 2)}x "
            f"({number(r['medians']['paged-backend']['one_stream'])} vs "
            f"{number(r['medians']['llama.cpp']['one_stream'])} tok/s)")


HEADLINE: list[tuple[str, str, Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], str]]] = [
    ("cpu_peers", "avx512",
     lambda r: f"served over HTTP on 2 cores, default model: {r['workload']['chats']} chats at once vs "
               "vLLM's CPU backend (bf16); one stream vs llama.cpp (same GGUF file)",
     cpu_peers_headline),
    ("cpu_peers", "avx2",
     lambda r: "the same on an AVX2-only CPU (no native bf16: this engine's int4 over fp32, vLLM's bf16)",
     cpu_peers_headline),
    ("throughput", "unrecorded",
     lambda r: f"{r['workload']['num_prompts']} MT-bench chats, default model in fp32: engine vs HF `generate` static batches",
     lambda r: f"{number(r['systems']['engine']['tokens_per_s'])} vs {number(r['systems']['static']['tokens_per_s'])} tok/s "
               f"({number(r['ratios']['engine_vs_static'], 2)}x)"),
    ("throughput", "unrecorded", lambda r: "the same: engine vs transformers' continuous batching (peak RSS)",
     lambda r: f"{number(r['ratios']['engine_vs_hf_cb'], 2)}x ({r['systems']['engine']['peak_rss_mb']:.0f} vs "
               f"{r['systems']['hf_cb']['peak_rss_mb']:.0f} MB)"),
    ("prefix_cache", "unrecorded",
     lambda r: f"{r['args']['num_requests']} chats sharing a {r['args']['system_tokens']}-token system prompt: "
               "prefix caching on vs off",
     lambda r: f"{number(r['ratio'], 2)}x (hit rate {number(r['on']['hit_rate'], 2)})"),
    ("pipeline", "unrecorded",
     lambda r: f"`PagedTextGenerationPipeline` vs the stock pipeline (batch size {r['workload']['stock_batch_size']})",
     lambda r: f"{number(r['throughput_ratio'], 2)}x, identical outputs {r['identical_outputs']}"),
    ("structured", "unrecorded",
     lambda r: f"JSON-schema-constrained vs free generation, {r['args']['num_prompts']} extraction prompts",
     lambda r: f"{number(r['ratio'], 2)}x, {r['valid']} of {r['num_answers']} valid"),
    ("speculative", "avx2", lambda r: "n-gram speculation vs plain decoding, one stream, fp32 (identical outputs)",
     lambda r: f"{number(r['single_stream']['spec']['ratio'], 3)}x"),
    ("lora", "avx2",
     lambda r: f"{r['workload']['adapters']} LoRA adapters in one batch vs PEFT, one adapter at a time",
     lambda r: f"{number(r['ratios']['lora_vs_peft_sequential'], 2)}x"),
    ("sliding_window_memory", "avx512",
     lambda r: "Gemma 3 (5 window layers : 1 full), one KV budget: window blocks freed vs every block kept",
     lambda r: f"{number(r['sequences_held_ratio'], 2)}x the sequences held, KV per sequence at {r['context']} tokens "
               f"{number(r['kv_bytes_per_sequence_ratio_to_need']['free_window_blocks'], 2)}x what the window needs"),
    ("startup", "avx512", lambda r: "start-up of `LLM()` (default model), each start its own process: eager / cold compile / "
                                    "warm compile (graphs loaded from the compile cache)",
     lambda r: f"{number(r['eager']['median_process_s'])} / {number(r['cold_compiled']['median_process_s'])} / "
               f"{number(r['warm_compiled']['median_process_s'])} s"),
    ("cpu_vs_llamacpp", "avx512", lambda r: "default model (int4) one stream vs llama.cpp on the same GGUF file",
     lambda r: f"{number(r['medians']['engine_one_stream'])} vs {number(r['medians']['llamacpp_one_stream'])} tok/s "
               f"({number(r['ratios']['one_stream'], 2)}x); throughput workload "
               f"{number(r['ratios']['throughput_over_llamacpp_one_stream'], 2)}x llama.cpp's one stream"),
    ("cpu_attention", "avx512", lambda r: "throughput workload at the defaults: the compiled CPU attention kernel vs "
                                          "PyTorch ops",
     lambda r: f"{number(r['engine']['median_tokens_per_s']['kernel'] / r['engine']['median_tokens_per_s']['torch_ops'], 2)}x "
               f"({number(r['engine']['median_tokens_per_s']['kernel'])} vs "
               f"{number(r['engine']['median_tokens_per_s']['torch_ops'])} tok/s)"),
    ("cpu_int4_batch", "avx512", lambda r: "throughput workload at the defaults: the compiled CPU int4 kernel vs torch's",
     cpu_int4_batch_headline),
    ("cpu_int4_batch", "avx2", lambda r: "the same on an AVX2-only CPU (an fp32 model's int4 layers)",
     cpu_int4_batch_headline),
    ("quantized_checkpoints", "avx512",
     lambda r: "a GPTQ 4-bit checkpoint of the default model's shape vs the int4 path, one stream (its fp16 LM head "
               "as the file has it / made int8 as the int4 path's is); memory beyond the process before loading",
     lambda r: f"{number(r['ratio_gptq_over_int4'], 2)}x / {number(r['ratio_gptq_int8_head_over_int4'], 2)}x; "
               f"{number(r['summary']['gptq']['loaded_mib'])} MiB resident after loading, for "
               f"{number(r['checkpoint_file_mib'])} MiB of files (int4 path {number(r['summary']['int4']['loaded_mib'])} MiB)"),
    ("quantized_checkpoints", "avx2",
     lambda r: "the same on an AVX2-only CPU, where the fp32 engine keeps the checkpoint's fp16 LM head in fp16 (widened "
               "to fp32, as before / made int8)",
     lambda r: f"{number(r['ratio_gptq_over_int4'], 2)}x ({number(r['ratio_gptq_fp32_head_over_int4'], 2)}x / "
               f"{number(r['ratio_gptq_int8_head_over_int4'], 2)}x); {number(r['summary']['gptq']['loaded_mib'])} MiB "
               f"resident after loading (int4 path {number(r['summary']['int4']['loaded_mib'])} MiB)"),
]
HEADLINE.append(
    ("kv_offload", "avx2",
     lambda r: f"first token of a {r['restart']['prompt_tokens']}-token chat after a restart, its "
               f"{r['restart']['warm_cached_tokens'][0]}-token prefix read back from the disk tier, vs a cold prefill",
     lambda r: f"{number(r['restart']['ratio'], 3)}x the time ({number(r['restart']['warm_median_s'], 2)} vs "
               f"{number(r['restart']['cold_median_s'], 1)} s), same tokens: {r['restart']['same_tokens']}"))
HEADLINE.append(
    ("rl_rollouts", "avx2",
     lambda r: f"one GRPO step's sampled rollouts ({r['workload']['rows']} rows, {r['workload']['dtype']}) on the model "
               "being trained: the engine through `generate_batch` vs TRL's plain `generate` / transformers' "
               "`generate_batch`",
     lambda r: f"{number(r['ratios']['engine_generate_batch / trl_generate'], 2)}x / "
               f"{number(r['ratios']['engine_generate_batch / hf_generate_batch'], 2)}x "
               f"({number(r['systems']['engine_generate_batch']['tokens_per_s'])} vs "
               f"{number(r['systems']['trl_generate']['tokens_per_s'])} / "
               f"{number(r['systems']['hf_generate_batch']['tokens_per_s'])} tok/s)"))
HEADLINE_CHART = ("throughput", "unrecorded")


def readme_section() -> str:
    """The README's headline chart and table of current results."""
    records = {(b, m): r for b, m, r in current_results()}
    benchmark, machine = HEADLINE_CHART
    lines = [f"![Output tokens/s on the throughput workload](docs/assets/benchmarks/{benchmark}_{machine}.png)\n",
             "| measured | result | machine | command |", "|---|---|---|---|"]
    for benchmark, machine, what, figure in HEADLINE:
        record = records.get((benchmark, machine))
        if record is None:
            raise FileNotFoundError(f"the README's results table shows benchmarks/results/{benchmark}_{machine}.json, "
                                    "which is gone: point HEADLINE in benchmarks/charts.py at the current file")
        lines.append(f"| {what(record)} | {figure(record)} | `{machine}` | `{record['provenance']['command']}` |")
    return "\n".join(lines)


SECTIONS: dict[Path, dict[str, Callable[[], str]]] = {
    BENCHMARKS_PAGE: {"benchmark-results": benchmarks_section},
    README: {"readme-results": readme_section},
}


def draw_charts() -> None:
    for benchmark, machine, record in current_results():
        if benchmark in CHARTS:
            out = CHARTS_DIR / f"{benchmark}_{machine}.png"
            print(f"{benchmark} ({machine}): {draw(benchmark, record, RESULTS_DIR / f'{benchmark}_{machine}.json', out)}")


def stale_sections() -> list[str]:
    return [f"{path.relative_to(ROOT)}: {name}" for path, generators in SECTIONS.items()
            for name in generated_sections.stale(path, generators)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="charts and result tables from benchmarks/results/")
    parser.add_argument("--check", action="store_true", help="change nothing; fail when a generated section is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_sections()
        for name in stale:
            print(f"stale: {name} (run python benchmarks/charts.py)")
        return 1 if stale else 0
    draw_charts()
    for path, generators in SECTIONS.items():
        if generated_sections.rewrite(path, generators):
            print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
