"""PagedLLM (LangChain BaseLLM) on the shared default-model engine: batching, stops, streaming,
usage, concurrency, timeouts. There is no standard LangChain suite for plain LLMs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.engine import peak_in_flight as record_peak
from langchain_core.callbacks import BaseCallbackHandler
from paged_backend.integrations.langchain import ChatPaged, PagedLLM, get_async_engine
from paged_backend.integrations.langchain.engines import build_key

from paged_backend import AsyncEngine, SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def aengine() -> AsyncEngine:
    return get_async_engine()


@pytest.fixture()
def peak_in_flight(aengine: AsyncEngine) -> Iterator[list[int]]:
    """Records, before every engine step, how many requests the engine holds."""
    with record_peak(aengine.engine) as peaks:
        yield peaks


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_construction_loads_nothing_and_equal_settings_share_an_engine(aengine: AsyncEngine) -> None:
    PagedLLM(model="/no/such/model")  # would fail if construction loaded it
    assert PagedLLM().async_engine is ChatPaged().async_engine is aengine
    assert build_key(None, None, {}) != build_key(None, None, {"max_num_seqs": 8})
    assert PagedLLM(model=aengine.engine).async_engine is aengine


def test_batch_is_one_submission_in_input_order(aengine: AsyncEngine, peak_in_flight: list[int]) -> None:
    llm = PagedLLM(temperature=0, max_tokens=6)
    prompts = [f"Count from {i}:" for i in range(8)]
    results = llm.batch(prompts)
    assert peak_in_flight[0] == 8  # all eight were in the engine together
    assert results[5] == llm.invoke(prompts[5])


def test_stops_merge_and_cut_before_the_match() -> None:
    llm = PagedLLM(temperature=0, max_tokens=16)
    full = llm.invoke(PROMPT)
    words = full.split()
    early, late = words[1], words[-1]
    cut = llm.invoke(PROMPT, stop=[early])
    assert cut == full[:full.index(early)]
    assert PagedLLM(temperature=0, max_tokens=16, stop=[late]).invoke(PROMPT, stop=[early]) == cut
    assert PagedLLM(temperature=0, max_tokens=16, stop=[early]).invoke(PROMPT) == cut
    assert llm.sampling_params(["b"], {}).stop == ["b"]
    assert PagedLLM(stop=["a", "b"]).sampling_params(["b", "c"], {}).stop == ["a", "b", "c"]


def test_stream_calls_back_once_per_chunk_and_matches_invoke() -> None:
    llm = PagedLLM(temperature=0, max_tokens=10)
    counter = TokenCounter()
    chunks = list(llm.stream(PROMPT, config={"callbacks": [counter]}))
    assert len(chunks) >= 5 and counter.tokens == [c for c in chunks]
    assert "".join(chunks) == llm.invoke(PROMPT)


async def test_astream_calls_back_per_chunk() -> None:
    llm = PagedLLM(temperature=0, max_tokens=10)
    counter = TokenCounter()
    chunks = [c async for c in llm.astream(PROMPT, config={"callbacks": [counter]})]
    assert len(chunks) >= 5 and counter.tokens == chunks
    assert "".join(chunks) == await llm.ainvoke(PROMPT)


def test_usage_finish_reason_and_logprobs() -> None:
    llm = PagedLLM(temperature=0, max_tokens=5, logprobs=2)
    result = llm.generate(["Hello", "Paris is"])
    usage = result.llm_output["token_usage"]
    tokenizer = llm.async_engine.engine.tokenizer
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in ["Hello", "Paris is"])
    assert usage["prompt_tokens"] == prompt_tokens == llm.get_num_tokens("Hello") + llm.get_num_tokens("Paris is")
    assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
    assert result.llm_output["model_name"] == "SmolLM2-135M-Instruct"
    for [generation] in result.generations:
        info = generation.generation_info
        assert info["finish_reason"] in ("stop", "length")
        logprobs = info["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) <= 5
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
        assert all(lp <= 0 for lp in logprobs["token_logprobs"])


def test_n_samples_give_n_generations_per_prompt() -> None:
    result = PagedLLM(n=2, temperature=1.0, seed=0, max_tokens=3, logprobs=0).generate(["Once upon", "Hello"])
    assert [len(g) for g in result.generations] == [2, 2]
    samples = [g.generation_info["logprobs"]["tokens"] for gens in result.generations for g in gens]
    assert ["".join(tokens) for tokens in samples] == [g.text for gens in result.generations for g in gens]
    assert result.llm_output["token_usage"]["completion_tokens"] == sum(len(tokens) for tokens in samples)


def test_best_of_keeps_the_best_sample_per_prompt() -> None:
    every = PagedLLM(n=3, temperature=1.0, seed=8, max_tokens=6, logprobs=0).generate(["Once upon a time"])
    scores = [sum(g.generation_info["logprobs"]["token_logprobs"]) / len(g.generation_info["logprobs"]["token_logprobs"])
              for g in every.generations[0]]
    assert scores.index(max(scores)) != 0  # so keeping the first sample would fail
    best = PagedLLM(best_of=3, temperature=1.0, seed=8, max_tokens=6).generate(["Once upon a time"])
    assert [g.text for g in best.generations[0]] == [every.generations[0][scores.index(max(scores))].text]


async def test_32_concurrent_ainvokes_share_the_engine() -> None:
    # fp32 weights named: the int4 default multiplies a large step by its dense copy and a small one by the codes, so
    # its answers may part at a near-tie between a prompt batched and the same prompt alone.
    llm = PagedLLM(temperature=0, max_tokens=4, engine_config={"dtype": torch.float32})
    with record_peak(llm.async_engine.engine) as peak_in_flight:
        texts = await asyncio.gather(*(llm.ainvoke(f"Item {i}:") for i in range(32)))
    assert len(texts) == 32 and peak_in_flight[0] == 32
    for i in (0, 13, 31):  # each answer is the one its prompt gets alone
        assert texts[i] == await llm.ainvoke(f"Item {i}:")


def test_timeout_aborts_the_request(aengine: AsyncEngine) -> None:
    with pytest.raises(TimeoutError):
        PagedLLM(max_tokens=200, timeout=0.05).invoke(PROMPT)
    PagedLLM(max_tokens=1).invoke("x")  # the abort is applied before this request runs
    assert not aengine.engine.requests


def test_bad_options_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="frobnicate"):
        PagedLLM(max_tokens=1).invoke(PROMPT, frobnicate=True)
    with pytest.raises(NotImplementedError, match="n > 1"):
        list(PagedLLM(n=2, max_tokens=1).stream(PROMPT))
    with pytest.raises(NotImplementedError, match="best_of > 1"):
        list(PagedLLM(best_of=2, max_tokens=1).stream(PROMPT))
    with pytest.raises(ValueError):
        PagedLLM(max_tokens=1, colour="red")
    with pytest.raises(ValueError, match="prompt 1"):
        PagedLLM(max_tokens=1).batch(["fine", ""])


def test_structured_outputs_as_an_option_and_per_call() -> None:
    import re

    llm = PagedLLM(temperature=1.0, seed=0, max_tokens=12, structured_outputs={"choice": ["red", "green", "blue"]})
    assert set(llm.batch([PROMPT, "My favourite colour is"])) <= {"red", "green", "blue"}
    code = llm.invoke("A code:", structured_outputs={"regex": "[A-Z]{2}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{2}", code)
    streamed = "".join(llm.stream("A code:", structured_outputs={"regex": "[A-Z]{2}-[0-9]{2}"}))
    assert streamed == code
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        llm.invoke(PROMPT, structured_outputs={"regex": "[A-"})


async def test_truncate_prompt_tokens_answers_from_the_prompt_tail(aengine: AsyncEngine) -> None:
    """The option passes through LangChain (constructor or call) to the engine, which keeps the last k tokens."""
    text = await PagedLLM(temperature=0, max_tokens=4, truncate_prompt_tokens=3).ainvoke(PROMPT)
    tail = aengine.engine.tokenizer(PROMPT)["input_ids"][-3:]
    async for output in aengine.generate(tail, SamplingParams(temperature=0, max_tokens=4)):
        last = output
    assert text == last.outputs[0].text
    assert await PagedLLM(temperature=0, max_tokens=4).ainvoke(PROMPT, truncate_prompt_tokens=3) == text
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PagedLLM(max_tokens=1).invoke(PROMPT, truncate_prompt_tokens=0)
