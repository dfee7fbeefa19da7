"""Shared KV blocks: automatic prefix caching and parallel sampling (n > 1)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine import (
    MT_BENCH,
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import build

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.core import kv_cache_manager

MAX_NEW = 10


@pytest.fixture(scope="module")
def model():
    return build("qwen2")


@pytest.fixture(scope="module")
def shared_prompts(model):
    """12 prompts, most sharing a 37-token system prefix, plus their HF references."""
    system = mixed_prompts(1, seed=7)[0] + mixed_prompts(1, seed=8)[0]
    system = (system * 2)[:37]
    tails = mixed_prompts(12, seed=3)
    prompts = [system + t if i % 4 else t for i, t in enumerate(tails)]
    return prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


def run_all(engine: Engine, prompts: list[list[int]]) -> list:
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    return [finals[i] for i in ids]


@pytest.mark.parametrize("config", [dict(num_kv_blocks=128), dict(num_kv_blocks=40, block_size=4,
                                                                    max_num_batched_tokens=24)])
def test_greedy_equality_cold_and_warm_cache(model, shared_prompts, config):
    prompts, refs = shared_prompts
    engine = Engine(model, None, EngineConfig(**config))
    cold = run_all(engine, prompts)
    warm = run_all(engine, prompts)  # the same prompts again: every full prompt block is a hit
    for i, ref in enumerate(refs):
        assert cold[i].outputs[0].token_ids == ref
        assert warm[i].outputs[0].token_ids == ref
    assert sum(o.num_cached_tokens for o in warm) > sum(o.num_cached_tokens for o in cold)
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert_all_blocks_free(engine)


def test_cached_tokens_reported_and_last_token_computed(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    prompt = list(range(1, 17))  # exactly 4 full blocks
    first = run_all(engine, [prompt])[0]
    second = run_all(engine, [prompt])[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12  # the block holding the last prompt token is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_prompt_sent_several_times_at_once_is_computed_once(model, shared_prompts):
    """TRL's num_generations rows: the same prompt as separate requests in one batch. The first computes it; the
    others wait for it, then take its full blocks from the cache, with the tokens a lone request gets."""
    prompts, refs = shared_prompts
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=24))
    outs = run_all(engine, [prompts[1]] * 4 + [prompts[2]] * 2)
    full = (len(prompts[1]) - 1) // 4 * 4, (len(prompts[2]) - 1) // 4 * 4  # each prompt's full-block tokens
    assert [o.num_cached_tokens for o in outs] == [0] + [full[0]] * 3 + [0, full[1]]
    assert [o.outputs[0].token_ids for o in outs] == [refs[1]] * 4 + [refs[2]] * 2
    assert not engine.scheduler.prompt_leaders
    assert_all_blocks_free(engine)


def test_only_a_running_twin_under_the_same_salt_is_waited_for(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    prompt = list(range(1, 21))
    first = engine.add_request(prompt, greedy(2))
    other_tenant = engine.add_request(prompt, greedy(2), cache_salt="b")
    twin = engine.add_request(prompt, greedy(2))
    engine.step()  # the first prompt's first 8 tokens
    waiting = {request.request_id: request for request in engine.scheduler.waiting}
    assert engine.scheduler.waits_for_twin(waiting[twin])
    assert not engine.scheduler.waits_for_twin(waiting[other_tenant])
    engine.abort_request(first)
    assert not engine.scheduler.waits_for_twin(waiting[twin])
    finals = run_to_completion(engine)
    assert finals[twin].num_cached_tokens == 8  # what the aborted request had computed
    assert finals[other_tenant].num_cached_tokens == 0
    assert_all_blocks_free(engine)


def test_prefix_caching_off_shares_nothing(model, shared_prompts):
    prompts, refs = shared_prompts
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, enable_prefix_caching=False))
    run_all(engine, prompts)
    again = run_all(engine, prompts)
    assert [o.outputs[0].token_ids for o in again] == refs
    assert all(o.num_cached_tokens == 0 for o in again)


def test_cache_salt_isolates_tenants(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    prompt = list(range(1, 21))
    engine.add_request(prompt, greedy(2), cache_salt="a")
    run_to_completion(engine)
    rid = engine.add_request(prompt, greedy(2), cache_salt="b")
    assert run_to_completion(engine)[rid].num_cached_tokens == 0
    rid = engine.add_request(prompt, greedy(2), cache_salt="a")
    assert run_to_completion(engine)[rid].num_cached_tokens == 16


def test_each_tenant_hits_its_own_cached_prefix(model):
    """Tenants sending the same prompt each keep their own cache entries: every tenant's repeat is a hit,
    whichever tenant cached the prompt first."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=4))
    prompt = list(range(1, 21))
    for salt in ("a", "b", None):
        rid = engine.add_request(prompt, greedy(2), cache_salt=salt)
        assert run_to_completion(engine)[rid].num_cached_tokens == 0, salt
    for salt in ("b", "a", None, "b"):
        rid = engine.add_request(prompt, greedy(2), cache_salt=salt)
        assert run_to_completion(engine)[rid].num_cached_tokens == 16, salt
    assert_all_blocks_free(engine)


def test_salts_hash_differently_and_only_the_first_block_carries_one():
    tokens = (1, 2, 3, 4)
    hashes = {kv_cache_manager.hash_block((None, tokens, salt, None, None)) for salt in (None, "a", "b", "")}
    assert len(hashes) == 4
    parent = kv_cache_manager.hash_block((None, tokens, None, None, None))
    assert kv_cache_manager.hash_block((parent, tokens, None, None, None)) != parent  # the parent is part of the hash


def test_forced_hash_collision_never_serves_other_kv(model, shared_prompts, monkeypatch):
    """With every block hashing to the same value, only the stored key can tell blocks apart."""
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda key: 42)
    prompts, refs = shared_prompts
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=4))
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in run_all(engine, prompts)] == refs
    assert_all_blocks_free(engine)


def test_freed_blocks_keep_their_hash_until_evicted_lru(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=12, block_size=4))
    a, b = list(range(1, 18)), list(range(100, 117))
    run_all(engine, [a])
    assert run_all(engine, [a])[0].num_cached_tokens == 16
    run_all(engine, [b])  # 12 blocks: b's blocks push out the least recently used of a's
    run_all(engine, [b])
    assert run_all(engine, [b])[0].num_cached_tokens == 16


def test_reset_prefix_cache_forgets_cached_prefixes_only_when_no_block_is_held(model, shared_prompts):
    prompts, refs = shared_prompts
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128))
    run_all(engine, prompts[:4])
    engine.add_request(prompts[4], greedy(MAX_NEW), request_id="running")
    engine.step()
    assert not engine.reset_prefix_cache()  # a request holds blocks: nothing is forgotten
    run_to_completion(engine)
    assert engine.reset_prefix_cache()
    again = run_all(engine, prompts[:4])
    assert [o.num_cached_tokens for o in again] == [0, 0, 0, 0]
    assert [o.outputs[0].token_ids for o in again] == refs[:4]
    assert sum(o.num_cached_tokens for o in run_all(engine, prompts[:4])) > 0  # cached anew after the reset
    assert_all_blocks_free(engine)


def test_parallel_sampling_returns_n_distinct_samples_in_order(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128))
    prompt = mixed_prompts(1, seed=5)[0]
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=10, max_tokens=8, ignore_eos=True))
    out = run_to_completion(engine)[rid]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1
    for i, sample in enumerate(samples):  # sample i is the n = 1 request with seed 10 + i
        single = engine.add_request(prompt, SamplingParams(temperature=1.0, seed=10 + i, max_tokens=8,
                                                           ignore_eos=True))
        assert run_to_completion(engine)[single].outputs[0].token_ids == sample
    assert_all_blocks_free(engine)


def test_parallel_sampling_shares_the_prompt_blocks():
    torch.manual_seed(0)
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    model = tf.LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, 256, (512,)).tolist()

    def peak_blocks(n: int) -> int:
        engine = Engine(model, None, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=1024))
        engine.add_request(prompt, SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=16, ignore_eos=True))
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.pool.num_blocks - engine.kv.pool.num_free)
        return peak

    one, four = peak_blocks(1), peak_blocks(4)
    assert four <= 1.3 * one, (one, four)


@pytest.mark.slow
def test_multi_turn_reuses_turn_one_context(default_llm):
    """MT-bench turn 2, sent after turn 1's answer, finds every full block of turn 1's context cached."""
    questions = [json.loads(line) for line in (MT_BENCH / "mt_bench_questions.jsonl").open()][:3]
    tok, engine = default_llm.tokenizer, default_llm.engine
    bs = engine.kv.block_size
    for q in questions:
        turn1 = [{"role": "user", "content": q["turns"][0]}]
        out1 = default_llm.chat([turn1], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
        context1 = out1.prompt_token_ids + out1.outputs[0].token_ids
        turn2 = turn1 + [{"role": "assistant", "content": out1.outputs[0].text},
                         {"role": "user", "content": q["turns"][1]}]
        prompt2 = tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True, return_dict=False)
        shared = next((i for i, (a, b) in enumerate(zip(context1, prompt2)) if a != b), len(context1))
        assert shared >= len(out1.prompt_token_ids) + len(out1.outputs[0].token_ids) - 1
        out2 = default_llm.generate([prompt2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert out2.num_cached_tokens >= (shared // bs) * bs


def test_streamed_samples_have_attributable_deltas(model):
    """With n > 1 each streamed output carries one sample and its delta; the last one carries all."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128))
    prompt = mixed_prompts(1, seed=5)[0]
    rid = engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True))
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    *running, final = outputs
    for out in running:
        assert not out.finished and len(out.outputs) == 1
        streamed[out.outputs[0].index] += out.delta_token_ids
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2] and final.delta_token_ids == []
    assert all(streamed[c.index] == c.token_ids for c in final.outputs)


def test_best_of_returns_the_n_samples_with_the_best_mean_logprob(model):
    """best_of=5, n=2: the two of the five seeded samples (as n=5 gives them) that score best per token."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128))
    prompt = mixed_prompts(1, seed=5)[0]
    sampling = {"temperature": 1.0, "seed": 3, "ignore_eos": True, "stop_token_ids": [7]}  # lengths differ
    every = engine.add_request(prompt, SamplingParams(n=5, max_tokens=12, logprobs=0, **sampling))
    candidates = run_to_completion(engine)[every].outputs
    ranked = sorted(candidates, key=lambda c: -c.cumulative_logprob / len(c.token_ids))
    assert len({round(c.cumulative_logprob / len(c.token_ids), 6) for c in candidates}) == 5  # no ties to hide order
    assert [c.index for c in ranked[:2]] != [0, 1]  # so returning the first n samples would fail

    best = engine.add_request(prompt, SamplingParams(n=2, best_of=5, max_tokens=12, **sampling))
    outputs = []
    while engine.has_unfinished_requests():  # asked to stream, it still sends only the final output
        outputs += [o for o in engine.step() if o.request_id == best]
    [final] = outputs
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.text for c in final.outputs] == [c.text for c in ranked[:2]]
    assert final.outputs[0].cumulative_logprob is None  # logprobs were not asked for
    assert_all_blocks_free(engine)


def test_best_of_is_checked_and_aborts_cleanly(model):
    with pytest.raises(ValueError, match=r"best_of=2: must be an int >= n \(3\)"):
        SamplingParams(n=3, best_of=2)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128))
    rid = engine.add_request([5, 6, 7], SamplingParams(best_of=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(rid)
    [final] = [o for o in engine.step() if o.request_id == rid]
    assert final.finished and len(final.outputs) == 1 and final.outputs[0].finish_reason == "abort"
    assert_all_blocks_free(engine)
