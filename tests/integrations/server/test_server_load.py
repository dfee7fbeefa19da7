"""Bounded load on the server: 64 concurrent streaming chats through the real async `openai` client.

The model is a random two-layer Llama (built here, no training) with a tiny byte-level BPE tokenizer:
its greedy answers depend strongly on the prompt, so an answer delivered to the wrong client, or
corrupted by its batch-mates, would not match the same request sent alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import torch
from helpers.server import (
    Served,
    build_chat_tokenizer,
    serve,
    tiny_llama,
    wait_all_blocks_free,
)

from paged_backend import LLM

pytestmark = pytest.mark.timeout(150)

CLIENTS = 64
MAX_TOKENS = 8
TOPICS = ["apples", "rivers", "engines", "music", "winter", "chess", "bridges", "stars"]


def question(i: int) -> str:
    return f"Question {i}: tell me {i % 5 + 1} things about {TOPICS[i % len(TOPICS)]}" + "?" * (i % 3 + 1)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tokenizer = build_chat_tokenizer([question(i) for i in range(CLIENTS)] * 3)
    model = tiny_llama(tokenizer, seed=1)
    with torch.no_grad():  # a wide init spreads the logits, so greedy argmax has no near-ties to flip
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    with serve(LLM(model, tokenizer, num_kv_blocks=512), "tiny-load") as server:
        yield server


async def ask(client: openai.AsyncOpenAI, i: int, max_tokens: int = MAX_TOKENS, leave_after: int | None = None) -> str:
    """Stream one greedy chat answer; with `leave_after`, hang up after that many chunks."""
    stream = await client.chat.completions.create(
        model="tiny-load", messages=[{"role": "user", "content": question(i)}], temperature=0,
        max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
    text, count = "", 0
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        count += 1
        if leave_after is not None and count >= leave_after:
            await stream.close()
            break
    return text


async def alone_answers(served: Served) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0) as client:
        return [await ask(client, i) for i in range(CLIENTS)]


async def concurrent_answers(served: Served, leavers: set[int]) -> list[str]:
    # The client's default pool allows far more than 64 connections, so all 64 streams run at once.
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0,
                                  timeout=120) as client:
        return await asyncio.gather(*(ask(client, i, max_tokens=400 if i in leavers else MAX_TOKENS,
                                          leave_after=2 if i in leavers else None) for i in range(CLIENTS)))


@contextlib.contextmanager
def peak_running(served: Served) -> Iterator[list[int]]:
    """Sample the engine's running-batch size while the block runs; yields [peak] filled in at exit."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], served.aengine.engine.stats()["num_running"])
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


@pytest.fixture(scope="module")
def reference(served: Served) -> list[str]:
    answers = asyncio.run(alone_answers(served))
    assert len(set(answers)) > CLIENTS // 2, "answers too alike to tell a mix-up"
    return answers


def test_64_concurrent_streams_each_match_the_request_alone(served: Served, reference: list[str]) -> None:
    engine = served.aengine.engine
    with peak_running(served) as peak:
        answers = asyncio.run(concurrent_answers(served, leavers=set()))
    assert answers == reference
    assert peak[0] >= CLIENTS // 2, f"only {peak[0]} requests ever ran together"
    wait_all_blocks_free(served.aengine)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_a_third_hang_up_early_the_rest_are_intact(served: Served, reference: list[str]) -> None:
    engine = served.aengine.engine
    leavers = set(range(0, CLIENTS, 3))
    aborted_before = abort_count(served)
    answers = asyncio.run(concurrent_answers(served, leavers))
    assert [a for i, a in enumerate(answers) if i not in leavers] == \
        [r for i, r in enumerate(reference) if i not in leavers]
    wait_all_blocks_free(served.aengine)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    # Each hang-up aborted its request (400 tokens would have taken far longer than this test).
    assert abort_count(served) - aborted_before == len(leavers)


def abort_count(served: Served) -> float:
    import httpx

    for line in httpx.get(f"{served.url}/metrics").text.splitlines():
        if line.startswith('paged_backend_requests_total{finished_reason="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
