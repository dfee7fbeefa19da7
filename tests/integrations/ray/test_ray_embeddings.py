"""Embeddings over Ray replicas: the replicated engine client answers the pooling members of the
protocol like one engine, and refuses bad input before it travels."""

from __future__ import annotations

import asyncio
import os
import queue

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is first imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest
import torch
from helpers.server import build_chat_tokenizer, tiny_llama

from paged_backend import LLM, PoolingParams

ray = pytest.importorskip("ray")
from paged_backend.integrations.ray import ReplicatedLLM, start_local_ray

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TEXTS = ["The cat sat on the mat.", "A short one.", "Paged attention keeps blocks of keys and values."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-chat-llama")
    tokenizer = build_chat_tokenizer(TEXTS * 3)
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def replicated(model_dir):
    start_local_ray(num_cpus=2)
    llm = ReplicatedLLM(model_dir, num_replicas=1, num_cpus=0.5, request_timeout_s=60)
    yield llm
    llm.shutdown()
    ray.shutdown()


def test_replicas_embed_like_one_engine(replicated, model_dir) -> None:
    expected = [o.embedding for o in LLM(model_dir, num_threads=1).embed(TEXTS, PoolingParams("mean"), use_tqdm=False)]
    client = replicated.aengine
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    for i, text in enumerate(TEXTS):
        client.submit_pooling(text, PoolingParams("mean"), f"e{i}", lambda o, i=i: outputs.put((i, o)))
    got = dict(outputs.get(timeout=120) for _ in TEXTS)
    for i, want in enumerate(expected):
        assert got[i].error is None
        torch.testing.assert_close(got[i].embedding, want, atol=1e-6, rtol=1e-5)
    again = asyncio.run(client.embed(TEXTS[0], PoolingParams("mean")))
    torch.testing.assert_close(again.embedding, expected[0], atol=1e-6, rtol=1e-5)
    assert sum(client.router.outstanding) == 0


def test_bad_input_is_refused_before_it_reaches_a_replica(replicated) -> None:
    client = replicated.aengine
    with pytest.raises(ValueError, match="dimensions=8"):
        client.submit_pooling("hi", PoolingParams(dimensions=8), None, lambda o: None)
    with pytest.raises(ValueError, match="the input is empty"):
        asyncio.run(client.embed([]))
    with pytest.raises(ValueError, match="context length"):
        client.validate_pooling([1] * (client.max_model_len + 1), PoolingParams())
    assert sum(client.router.outstanding) == 0
