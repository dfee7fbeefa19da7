"""Window layers free their old blocks, end to end: greedy output still equals HF generate on models
whose sequences grow far past their window (mixed batches, chunked prefill, late arrivals, preemption,
prefix hits, parallel samples, beams, speculation), while each window group holds only its window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.engine import (  # noqa: F401
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    one_thread,
    run_to_completion,
)
from helpers.models import build, build_from_config
from helpers.windows import (
    BLOCK,
    CONFIGS,
    MAX_NEW,
    WINDOW,
    assert_equal_to_hf,
    long_prompts,
    pages_in_use,
    run_checking_windows,
)

from paged_backend import BeamSearchParams, Engine, EngineConfig, SamplingParams
from paged_backend.core.layer_specs import ChunkedAttentionSpec
from paged_backend.entrypoints.beam_search import beam_search


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    model = build_from_config(CONFIGS[request.param])
    prompts = long_prompts()
    return request.param, model, prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_the_window_groups_are_the_models(case):
    name, model, _, _ = case
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=BLOCK))
    windows = [getattr(g.spec, "window", None) for g in engine.kv.groups.groups]
    assert windows == {"gemma2": [None, WINDOW], "gemma3_text": [None] + [WINDOW] * 5, "mistral": [WINDOW]}[name]
    layers = model.config.num_hidden_layers
    assert engine.cache.kv.shape[0] == engine.kv.groups.group_size
    assert engine.kv.pool.num_blocks == 64 * layers // engine.kv.groups.group_size  # the same memory


def test_chunked_prefill_and_late_arrivals_match_hf_holding_only_the_windows(case):
    _, model, prompts, refs = case
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=32))
    assert_equal_to_hf(run_checking_windows(engine, prompts, late_from=5), refs)
    assert_all_blocks_free(engine)


def test_preemption_matches_hf(case):
    name, model, prompts, refs = case
    blocks = {"gemma2": 48, "gemma3_text": 24, "mistral": 12}[name]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=32))
    assert_equal_to_hf(run_checking_windows(engine, prompts, late_from=5), refs)
    assert engine.scheduler.num_preemptions >= 2
    assert_all_blocks_free(engine)


def test_a_window_model_holds_fewer_blocks_than_when_it_keeps_every_block(case):
    _, model, prompts, refs = case
    peaks, outputs = [], []
    for free in (True, False):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK, free_window_blocks=free))
        ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts[:4]]
        peak, finals = 0, {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            peak = max(peak, pages_in_use(engine))
        peaks.append(peak)
        outputs.append([finals[i] for i in ids])
    assert_equal_to_hf(outputs[0], refs[:4])
    assert_equal_to_hf(outputs[1], refs[:4])
    assert peaks[0] < 0.8 * peaks[1]


def test_prefix_hits_and_parallel_samples_match_hf(case):
    _, model, prompts, refs = case
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=64))
    first = run_checking_windows(engine, prompts[:6], late_from=6)
    assert_equal_to_hf(first, refs[:6])
    # The same prompts again: each finds its prompt cached (every group holding its part), and n=3 samples
    # share the leader's prompt blocks.
    again = run_checking_windows(engine, prompts[:6], late_from=6,
                                 params=SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert_equal_to_hf(again, refs[:6])
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_all_blocks_free(engine)


def test_ngram_speculation_matches_hf(case):
    _, model, prompts, refs = case
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=32,
                                              speculative_config=spec))
    assert_equal_to_hf(run_checking_windows(engine, prompts[:6], late_from=6), refs[:6])
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(engine)


def test_beam_search_matches_hf():
    model = build_from_config(CONFIGS["gemma3_text"], seed=3)
    model.config.eos_token_id = None
    prompts = long_prompts(2, seed=5)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK))
    outputs = beam_search(engine, prompts, BeamSearchParams(beam_width=3, max_tokens=40, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                                 max_new_tokens=40)
        assert [s.token_ids for s in output.sequences] == out[:, len(prompt):].tolist()
    assert_all_blocks_free(engine)


def test_an_int8_cache_gives_the_same_tokens_with_and_without_freeing():
    """int8 K/V read with their scales: the null block's zeroed scales and keys are masked like any key
    outside the window, so freeing changes no token."""
    model = build_from_config(CONFIGS["gemma3_text"])
    prompts = long_prompts()
    tokens = []
    for free in (True, False):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=48, block_size=BLOCK, max_num_batched_tokens=32,
                                                  kv_cache_dtype="int8", free_window_blocks=free))
        tokens.append([o.outputs[0].token_ids for o in run_checking_windows(engine, prompts[:6], late_from=6)])
        assert_all_blocks_free(engine)
    assert tokens[0] == tokens[1]


def test_window_layers_attend_over_their_window_never_the_null_block(case):
    """The runner hands a window group its sequences cropped to the window's first block: the attention
    reads no freed entry, and about a window of keys however long the sequence is."""
    _, model, prompts, refs = case
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=32))
    seen, forward = [], engine.runner.forward

    def recording_forward(inputs):
        seen.append(inputs)
        return forward(inputs)

    engine.runner.forward = recording_forward
    assert_equal_to_hf(run_checking_windows(engine, prompts[-3:], late_from=3), refs[-3:])
    cropped = 0
    for inputs in seen:
        queries = np.diff(inputs.metadata.query_start_loc_host)
        for group, step in zip(engine.kv.groups.groups, inputs.group_metadata):
            if not group.spec.frees_blocks:
                assert step.seq_lens_host == inputs.metadata.seq_lens_host
                continue
            tables = step.block_tables.numpy()
            for i, seq_len in enumerate(step.seq_lens_host):
                assert seq_len <= WINDOW - 1 + queries[i] + BLOCK
                assert engine.kv.null_block not in tables[i, : -(-seq_len // BLOCK)]
            cropped += step.seq_lens_host != inputs.metadata.seq_lens_host
    assert cropped


def test_stats_show_the_blocks_of_each_group(case):
    _, model, prompts, _ = case
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=BLOCK))
    engine.add_request(prompts[-1], greedy(MAX_NEW))
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    groups = engine.kv.groups.groups
    assert stats["kv_num_groups"] == len(groups)
    used = [stats[f"kv_group_{g}_blocks"] for g in range(len(groups))]
    assert sum(used) == stats["kv_blocks_total"] - stats["kv_blocks_free"]
    assert [stats[f"kv_group_{g}_window"] for g in range(len(groups))] == [getattr(g.spec, "window", 0) for g in groups]
    run_to_completion(engine)


def test_free_window_blocks_false_keeps_every_block_as_before(case):
    _, model, _, _ = case
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=BLOCK, free_window_blocks=False))
    assert engine.kv.groups.num_groups == 1 and not engine.kv.groups.frees_blocks
    assert engine.kv.pool.num_blocks == 64 and engine.cache.kv.shape[0] == model.config.num_hidden_layers
    assert "kv_num_groups" not in engine.stats()


def test_a_model_without_windows_keeps_its_blocks_and_stats():
    model = build("llama")
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    assert engine.kv.groups.num_groups == 1 and not engine.cache.grouped
    assert engine.kv.pool.num_blocks == 64 and engine.cache.kv.shape[0] == model.config.num_hidden_layers
    assert engine.cache.num_blocks == 64 and engine.kv.capacity_tokens == 64 * 4
    assert not any(key.startswith("kv_group") or key == "kv_num_groups" for key in engine.stats())


@pytest.mark.parametrize("block_size", [4, 6])
def test_chunked_layers_free_the_chunks_behind_them(block_size):
    """Llama 4's chunked layers (8-token chunks here) form groups of their own and give back the blocks before their
    next query's chunk, each request holding no more than a chunk and a step of them, while greedy output still
    equals HF generate through chunked prefill and late arrivals. Blocks of 6 are no divisor of the chunk: a view
    then starts where a chunk and a block both do (24 tokens), over freed entries the chunk mask hides."""
    model = build("llama4_text")
    prompts = long_prompts(6)
    refs = [hf_greedy(model, p, 20) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=block_size, max_num_batched_tokens=16))
    chunked = [g for g, group in enumerate(engine.kv.groups.groups) if group.spec == ChunkedAttentionSpec(8)]
    assert chunked and engine.cache.grouped
    ids = [engine.add_request(p, greedy(20)) for p in prompts[:3]]
    finals, freed, steps = {}, 0, 0
    while engine.has_unfinished_requests():
        if steps == 3:
            ids += [engine.add_request(p, greedy(20)) for p in prompts[3:]]
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        for request in engine.scheduler.running:
            for g in chunked:
                table = request.block_tables[g]
                held = sum(b != engine.kv.null_block for b in table)
                assert held <= ChunkedAttentionSpec(8).blocks_alone(len(table) * block_size, 16, block_size)
                freed += len(table) - held
    assert freed
    assert_equal_to_hf([finals[i] for i in ids], refs)
