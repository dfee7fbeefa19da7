"""AsyncEngine: one background loop, many coroutines and threads, aborts when a consumer leaves."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers.engine import assert_all_blocks_free, greedy, hf_greedy, mixed_prompts
from helpers.models import build

from paged_backend import AsyncEngine, Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture
def aengine(model):
    engine = AsyncEngine(Engine(model, None, EngineConfig(num_kv_blocks=128, max_num_seqs=64)))
    yield engine
    engine.shutdown()


async def collect(aengine: AsyncEngine, prompt: list[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    async for output in aengine.generate(prompt, greedy(max_tokens)):
        tokens += output.delta_token_ids
        if output.finished:
            assert tokens == output.outputs[0].token_ids
    return tokens


async def test_many_coroutines_get_their_own_tokens(model, aengine):
    prompts = mixed_prompts(16)
    results = await asyncio.gather(*[collect(aengine, p, 6) for p in prompts])
    assert results == [hf_greedy(model, p, 6) for p in prompts]
    assert_all_blocks_free(aengine.engine)


def test_threads_stream_concurrently(model, aengine):
    prompts = mixed_prompts(6, seed=4)
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = [t for o in aengine.stream(prompts[i], greedy(5)) for t in o.delta_token_ids]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(prompts))] == [hf_greedy(model, p, 5) for p in prompts]


async def test_a_consumer_that_leaves_aborts_its_request(aengine):
    stream = aengine.generate([1, 2, 3], greedy(200))
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):  # the abort reaches the engine thread at its next loop
        if not aengine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.05)
    assert not aengine.engine.has_unfinished_requests()
    assert_all_blocks_free(aengine.engine)


async def test_bad_request_raises_for_its_caller_only(model, aengine):
    good = asyncio.create_task(collect(aengine, [4, 5, 6], 6))
    with pytest.raises(ValueError, match="temperature"):
        bad = SamplingParams()
        bad.temperature = -1.0
        async for _ in aengine.generate([1, 2], bad):
            pass
    with pytest.raises(ValueError, match="empty"):
        async for _ in aengine.generate([], greedy(3)):
            pass
    assert await good == hf_greedy(model, [4, 5, 6], 6)


async def test_a_logits_processor_reaches_the_engine(model, aengine):
    """generate() and stream() hand their processor to the engine thread, which calls it per step."""
    prompt = [3, 4, 5, 6]
    free = hf_greedy(model, prompt, 4)

    def ban_first(output_ids, row):
        row[free[0]] = float("-inf")
        return row

    async_tokens = [o async for o in aengine.generate(prompt, greedy(4), logits_processor=ban_first)][-1]
    thread_tokens = list(aengine.stream(prompt, greedy(4), logits_processor=ban_first))[-1]
    for output in (async_tokens, thread_tokens):
        assert free[0] not in output.outputs[0].token_ids and len(output.outputs[0].token_ids) == 4
