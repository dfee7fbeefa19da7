"""Smoke test of benchmarks/throughput.py on a tiny random model: every system runs, the report has its fields.

Also checks the shared benchmark helpers (benchmarks/common.py) that the numbers rest on.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import charts
import common
import throughput
from helpers.models import build

SYSTEM_FIELDS = {"label", "useful_tokens", "tokens_per_s", "wall_s", "ttft_first_s", "ttft_median_s", "peak_rss_mb",
                 "run_peak_rss_mb", "setup_s", "tokens_equal_sequential"}
ENGINE_FIELDS = {"kv_utilisation_mean", "floor_s", "floor_cpu_s", "engine_over_floor", "engine_cpu_over_floor_cpu",
                 "step_over_floor_median", "num_steps", "step_tokens", "step_s", "forward_s"}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build("llama").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def workload() -> common.Workload:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 13, 7)]
    return common.Workload(prompts, common.draw_max_tokens(4, 3, 8, seed=0), pad_token_id=0)


def test_all_systems_report_their_fields(tiny_model_dir, workload, tmp_path):
    options = throughput.Options(cb_num_blocks=4, floor_repeats=1)  # keep transformers CB off 60% of RAM
    # The compiled engine runs the same code as "engine" after a compile that would dominate this test.
    systems = [s for s in throughput.SYSTEMS if s != "engine_compiled"]
    results = throughput.run_systems(workload, systems, tiny_model_dir, options, isolate=False)
    report = throughput.summarise(workload, results)

    assert set(report["systems"]) == set(systems)
    for name, summary in report["systems"].items():
        assert SYSTEM_FIELDS <= summary.keys(), name
        assert summary["useful_tokens"] == sum(workload.max_tokens)
        assert summary["tokens_per_s"] > 0 and summary["peak_rss_mb"] > 0
        assert 0 <= summary["ttft_first_s"] <= summary["wall_s"]
        # The tiny model has no near-ties, so every system must reproduce one-at-a-time generate exactly.
        expected = "reference" if name == "sequential" else {"equal": 4, "of": 4, "first_mismatch": None}
        assert summary["tokens_equal_sequential"] == expected, name
    for name, r in results.items():
        assert [len(t) for t in r["tokens"]] == workload.max_tokens, name
    engine = report["systems"]["engine"]
    assert ENGINE_FIELDS <= engine.keys()
    assert 0 < engine["kv_utilisation_mean"] <= 1 and engine["floor_s"] > 0
    # Every prompt token and every output token but the last is fed through exactly one packed forward.
    assert sum(engine["step_tokens"]) == sum(map(len, workload.prompt_token_ids)) + sum(workload.max_tokens) - 4
    assert len(engine["step_s"]) == engine["num_steps"]
    assert {t for t, _, _ in engine["floor_shape_s"]} == set(engine["step_tokens"])
    assert report["systems"]["static"]["computed_tokens"] == 4 * max(workload.max_tokens)
    assert set(report["ratios"]) == {"engine_vs_static", "engine_vs_hf_cb", "engine_vs_sequential",
                                     "compiled_vs_engine"}
    assert report["ratios"]["compiled_vs_engine"] is None  # not run
    # Every target is judged, except the compiled one, whose system did not run.
    assert all((r["met"] is None) == ("compiled" in r["target"]) for r in report["targets"])

    path = common.write_results(report, "throughput", tmp_path / "out.json")
    assert json.loads(path.read_text())["systems"]["engine"]["num_steps"] == engine["num_steps"]
    assert "paged-backend engine" in throughput.format_report(report)
    if importlib.util.find_spec("matplotlib"):
        chart = charts.draw("throughput", report, path)
        assert chart == path.with_suffix(".png") and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
def test_compiled_engine_system(tiny_model_dir, workload):
    """`engine_compiled` compiles at set-up (counted in setup_s and compile_s, not in the timed run) and
    gives the eager engine's tokens; its ratio and target are judged."""
    options = throughput.Options(floor_repeats=1)
    results = throughput.run_systems(workload, ["engine", "engine_compiled"], tiny_model_dir, options, isolate=False)
    compiled = results["engine_compiled"]
    assert compiled["tokens"] == results["engine"]["tokens"]
    assert compiled["compile_s"] > 0 and compiled["setup_s"] >= compiled["compile_s"]
    assert results["engine"]["compile_s"] is None
    report = throughput.summarise(workload, results)
    assert report["ratios"]["compiled_vs_engine"] > 0
    assert next(t for t in report["targets"] if "compiled" in t["target"])["met"] is not None


@pytest.mark.slow  # a worker process per system: the slow tier
def test_isolated_worker_returns_the_same_tokens(tiny_model_dir, workload):
    options = throughput.Options(floor_repeats=1, block_size=8)  # a non-default block size reaches the worker
    isolated = throughput.run_systems(workload, ["engine"], tiny_model_dir, options, isolate=True)["engine"]
    in_process = throughput.run_systems(workload, ["engine"], tiny_model_dir, options, isolate=False)["engine"]
    assert isolated["tokens"] == in_process["tokens"]
    assert isolated["block_size"] == in_process["block_size"] == 8
    assert isolated["peak_rss_mb"] > 0


def test_repeats_keep_each_systems_fastest_run(tiny_model_dir, workload):
    results = throughput.run_systems(workload, ["static"], tiny_model_dir, throughput.Options(), isolate=False,
                                     repeats=2)
    static = results["static"]
    assert len(static["wall_s_runs"]) == 2 and static["wall_s"] == min(static["wall_s_runs"])


def test_unknown_system_is_refused(tiny_model_dir, workload):
    with pytest.raises(ValueError, match="unknown systems"):
        throughput.run_systems(workload, ["vllm"], tiny_model_dir, throughput.Options(), isolate=False)


def test_compare_tokens_finds_first_mismatch():
    result = throughput.compare_tokens([[1, 2, 3], [4, 5, 9]], [[1, 2, 3], [4, 5, 6]])
    assert result == {"equal": 1, "of": 2, "first_mismatch": {"request": 1, "position": 2}}


def test_max_tokens_are_seeded_and_in_range():
    drawn = common.draw_max_tokens(32, 16, 128, seed=0)
    assert drawn == common.draw_max_tokens(32, 16, 128, seed=0)
    assert drawn != common.draw_max_tokens(32, 16, 128, seed=1)
    assert all(16 <= n <= 128 for n in drawn)


def test_prompts_come_from_the_data_env(tmp_path, monkeypatch):
    rows = [{"question_id": i, "turns": [f"first {i}", f"second {i}"]} for i in range(3)]
    (tmp_path / common.MT_BENCH_FILE).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv(common.DATA_ENV, str(tmp_path))
    assert common.load_mt_bench_prompts(2) == ["first 0", "first 1"]
    assert common.load_mt_bench_prompts(3, turn=1)[-1] == "second 2"
    with pytest.raises(ValueError, match="holds 3 questions"):
        common.load_mt_bench_prompts(4)


def test_rss_sampler_sees_an_allocation():
    with common.RSSSampler(interval_s=0.001) as rss:
        before = common.current_rss_bytes()
        # 64 MiB of fresh anonymous pages, each written so it is resident: memory from mmap cannot come
        # from what the allocator kept after earlier tests freed theirs, so RSS must grow by it.
        block = mmap.mmap(-1, 64 * common.MiB)
        for offset in range(0, 64 * common.MiB, mmap.PAGESIZE):
            block[offset] = 1
        time.sleep(0.2)  # the sampling thread, not the final reading at exit, has to see it
        block.close()
    assert rss.peak_bytes >= before + 48 * common.MiB
    # The kernel's high-water mark is the exact peak; its RSS counters are kept per thread and settle
    # a few pages late, so a sample can read a little above the mark taken just after it.
    assert common.peak_rss_bytes() >= rss.peak_bytes - 8 * common.MiB


def test_time_median_is_the_middle_timing():
    # Warm-up, then three timed calls; the gaps are wide so a loaded machine's late wake-ups can't reorder them.
    delays = iter([0.0, 0.5, 0.001, 0.1])

    def call():
        time.sleep(next(delays))

    assert 0.1 <= common.time_median(call, repeats=3, warmup=1) < 0.5


def test_speculative_benchmark_compares_engines_on_a_tiny_model():
    import speculative

    from paged_backend import Engine, EngineConfig

    assert len(speculative.grounded_prompts()) == 16
    model = build("llama")
    engines = {"plain": Engine(model, None, EngineConfig(num_kv_blocks=64)),
               "ngram": Engine(model, None, EngineConfig(num_kv_blocks=64, speculative_config={"prompt_lookup_min": 1})),
               "draft": Engine(model, None, EngineConfig(num_kv_blocks=64, speculative_config={"model": model}))}
    result = speculative.compare(engines, [[[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]], 12, repeats=1)
    assert result["outputs_identical"] and "plain_tokens_per_s" in result
    for name in ("ngram", "draft"):
        assert result[name]["proposed"] > 0
        assert {"tokens_per_s", "ratio", "acceptance_rate", "mean_accepted_length"} <= set(result[name])


def test_sliding_window_memory_benchmark_frees_window_blocks_with_the_same_tokens():
    import sliding_window_memory as swm

    from paged_backend import EngineConfig

    model = swm.tiny_gemma3(window=8, context=64)
    workload = swm.prompts(4, 56)
    runs = {free: swm.run_workload(model, EngineConfig(num_kv_blocks=16, block_size=4, max_num_batched_tokens=16,
                                                       free_window_blocks=free), workload, 8) for free in (False, True)}
    assert runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[True]["most_requests_running"] > runs[False]["most_requests_running"]
    assert runs[True]["kv_budget_bytes"] == runs[False]["kv_budget_bytes"]  # the same budget, cut into pages
    alone = swm.memory_alone(model, EngineConfig(num_kv_blocks=64, block_size=4), workload[0], 8)
    full, *windows = alone["pages_per_group"]
    assert full == 64 // 4 and len(windows) == 5  # the full layer holds all 64 tokens' blocks
    assert all(held <= -(-(8 - 1 + 1) // 4) + 1 for held in windows)  # a window layer: its 8 keys' blocks
