"""Prompt logprobs: each prompt token scored as the bare model scores it, however the prompt is
prefilled (whole, in chunks, after preemption, next to a cached copy of itself)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import (
    assert_all_blocks_free,
    greedy,
    mixed_prompts,
    run_to_completion,
)
from helpers.models import build
from helpers.tolerances import approx

from paged_backend import Engine, EngineConfig, SamplingParams

K = 3


@pytest.fixture(scope="module")
def model():
    return build("qwen2")


def reference(model, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[t] | prompt[:t]) for t >= 1, and each position's top-K, from one plain forward."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(model, prompt: list[int], scored: list) -> None:
    logprobs = reference(model, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for t in range(1, len(prompt)):
        row, entry = logprobs[t - 1], scored[t]
        token = prompt[t]
        assert entry[token].logprob == approx(row[token].item())
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(K)
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= K)
        assert [tid for _, tid in ranked] == top.indices.tolist()


@pytest.mark.parametrize("config", [
    {"num_kv_blocks": 128},
    {"num_kv_blocks": 128, "max_num_batched_tokens": 7},  # prompts prefilled in chunks of up to 7
    {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 24},  # preemption: prompts recomputed
])
def test_prompt_logprobs_match_the_bare_model(model, config):
    engine = Engine(model, None, EngineConfig(**config))
    prompts = mixed_prompts(8, seed=11)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=K))
           for p in prompts]
    plain = engine.add_request(prompts[0], greedy(6))  # a neighbour without them is unaffected
    finals = run_to_completion(engine)
    for request_id, prompt in zip(ids, prompts):
        check(model, prompt, finals[request_id].prompt_logprobs)
    assert finals[ids[0]].outputs[0].token_ids == finals[plain].outputs[0].token_ids
    assert finals[plain].prompt_logprobs is None
    if config["num_kv_blocks"] == 12:
        assert engine.stats()["num_preemptions"] > 0
    assert_all_blocks_free(engine)


def test_a_cached_prompt_is_still_scored_and_samples_share_one_score(model):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=4))
    prompt = mixed_prompts(1, seed=2)[0] * 2
    engine.add_request(prompt, greedy(2))
    run_to_completion(engine)  # now every full block of the prompt is cached
    rid = engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=3, prompt_logprobs=0))
    final = run_to_completion(engine)[rid]
    check_tokens_only(model, prompt, final.prompt_logprobs)
    assert final.num_cached_tokens == 0  # sample 0 skipped the cache to score the prompt
    assert len(final.outputs) == 3
    assert_all_blocks_free(engine)


def check_tokens_only(model, prompt: list[int], scored: list) -> None:
    logprobs = reference(model, prompt)
    assert scored[0] is None and [list(e) for e in scored[1:]] == [[t] for t in prompt[1:]]
    assert [e[t].logprob for e, t in zip(scored[1:], prompt[1:])] == approx(
        [logprobs[i, t].item() for i, t in enumerate(prompt[1:])])


def test_prompt_logprobs_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
