"""EngineClient: both engine clients answer the whole protocol, stats are read on the engine thread
only (a scrape never races a step), and a refused request ends with one shape of failed output."""

from __future__ import annotations

import inspect
import threading
import time

import pytest
from helpers.engine import assert_all_blocks_free, greedy, hf_greedy, mixed_prompts
from helpers.models import build

from paged_backend import (
    AsyncEngine,
    CompletionOutput,
    Engine,
    EngineConfig,
    RequestMetrics,
    RequestOutput,
)
from paged_backend.core.outputs import failed_output
from paged_backend.entrypoints.engine_client import EngineClient

pytestmark = pytest.mark.timeout(120)


def protocol_members() -> dict[str, object]:
    members = {name: value for name, value in vars(EngineClient).items()
               if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return members | {name: None for name in EngineClient.__annotations__}


def parameter_names(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("client_class", ["AsyncEngine", "ReplicatedAsyncEngine"])
def test_each_client_has_every_protocol_member_with_the_protocol_parameters(client_class):
    if client_class == "AsyncEngine":
        cls = AsyncEngine
    else:
        pytest.importorskip("ray")
        from paged_backend.integrations.ray.replicated_engine import (
            ReplicatedAsyncEngine as cls,
        )
    source = inspect.getsource(cls)
    for name, member in protocol_members().items():
        if member is None:  # a data attribute: set in __init__
            assert f"self.{name} = " in source, f"{cls.__name__} never sets {name}"
            continue
        implemented = getattr(cls, name, None)
        assert implemented is not None, f"{cls.__name__} lacks {name}"
        if isinstance(member, property):
            assert isinstance(implemented, property), f"{cls.__name__}.{name} should be a property"
            continue
        assert parameter_names(implemented) == parameter_names(member), name


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture
def aengine(model):
    client = AsyncEngine(Engine(model, None, EngineConfig(num_kv_blocks=128, max_num_seqs=8)))
    yield client
    client.shutdown()


def test_an_async_engine_is_an_engine_client(aengine):
    assert isinstance(aengine, EngineClient)
    assert (aengine.max_model_len, aengine.vocab_size) == (aengine.engine.max_model_len, aengine.engine.vocab_size)
    assert aengine.list_loras() == [] and not aengine.supports_lora


def test_stats_are_computed_on_the_engine_thread_while_scrapers_hammer_them(model, aengine):
    """Scrape threads call stats() as fast as they can while requests run: every call is answered by
    the engine thread between steps, the numbers are consistent, and generation is unchanged."""
    computed_on: set[str] = set()
    engine_stats = aengine.engine.stats

    def recording_stats():
        computed_on.add(threading.current_thread().name)
        return engine_stats()

    aengine.engine.stats = recording_stats
    stop = threading.Event()
    seen: list[dict] = []

    def scrape() -> None:
        while not stop.is_set():
            seen.append(aengine.stats())

    scrapers = [threading.Thread(target=scrape) for _ in range(3)]
    for thread in scrapers:
        thread.start()
    prompts = mixed_prompts(12)
    try:
        streams = [list(aengine.stream(p, greedy(6))) for p in prompts[:2]]
        outputs = run_all(aengine, prompts, 6)
    finally:
        stop.set()
        for thread in scrapers:
            thread.join()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 6) for p in prompts]
    assert [s[-1].outputs[0].token_ids for s in streams] == [hf_greedy(model, p, 6) for p in prompts[:2]]
    assert computed_on == {aengine.thread.name}
    assert len(seen) > 10
    assert any(s["num_running"] > 0 for s in seen)
    for s in seen:
        assert 0 <= s["kv_blocks_free"] <= s["kv_blocks_total"] and s["num_running"] <= 8
    assert_all_blocks_free(aengine.engine)


def run_all(aengine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    done = threading.Event()

    def sink_for(index: int):
        def sink(output: RequestOutput) -> None:
            if output.finished:
                finals[index] = output
                if len(finals) == len(prompts):
                    done.set()
        return sink

    for index, prompt in enumerate(prompts):
        aengine.submit(prompt, greedy(max_tokens), None, sink_for(index))
    assert done.wait(60)
    return [finals[i] for i in range(len(prompts))]


def test_stats_of_an_idle_engine_come_back_at_once_and_after_shutdown_still_come_back(aengine):
    start = time.monotonic()
    assert aengine.stats()["num_running"] == 0
    assert time.monotonic() - start < 0.4  # the idle engine thread is woken, not waited for
    aengine.shutdown()
    assert not aengine.is_alive()
    start = time.monotonic()
    assert aengine.stats()["kv_blocks_free"] == aengine.stats()["kv_blocks_total"]
    assert time.monotonic() - start < 0.4  # read at once: no engine thread left to ask


def test_validate_names_an_unknown_adapter_and_a_bad_prompt(aengine):
    with pytest.raises(ValueError, match="enable_lora"):
        aengine.validate([1, 2], greedy(2), lora="german")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        aengine.validate([10**6], greedy(2))
    aengine.validate([1, 2], greedy(2))


def test_a_duplicate_request_id_ends_with_a_failed_output_carrying_the_prompt(aengine):
    prompt = [5, 6, 7]
    first = aengine.stream(prompt, greedy(30), request_id="same")
    next(first)  # the first request is running
    refused = list(aengine.stream([9, 9], greedy(2), request_id="same"))
    first.close()
    assert len(refused) == 1
    out = refused[0]
    assert out.finished and out.outputs[0].finish_reason == "abort" and "already in use" in out.error
    assert out.prompt is None and out.prompt_token_ids == [9, 9] and out.outputs[0].token_ids == []


def test_failed_output_keeps_what_the_caller_already_received():
    streamed = RequestOutput("r", "hi", [1, 2], [CompletionOutput(0, "ab", [3, 4], finish_reason=None)], False,
                             RequestMetrics(arrival_time=1.0), delta_text="b", delta_token_ids=[4])
    out = failed_output("r", "hi", [1, 2], "replica died", streamed)
    assert out.finished and out.error == "replica died"
    assert out.outputs[0].token_ids == [3, 4] and out.outputs[0].text == "ab"
    assert out.outputs[0].finish_reason == "abort" and (out.delta_text, out.delta_token_ids) == ("", [])
    assert out.metrics.arrival_time == 1.0
    fresh = failed_output("r", "hi", [1, 2], "refused")
    assert (fresh.prompt, fresh.prompt_token_ids, fresh.outputs[0].token_ids) == ("hi", [1, 2], [])
