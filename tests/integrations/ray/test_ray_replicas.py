"""Engine replicas on Ray: routing, equivalence with one engine, streaming, LoRA adapters, Serve, and a
killed replica.

One local Ray instance (2 CPUs, 127.0.0.1 only) and two tiny-Llama replicas (LoRA enabled) serve the
whole module; the last test kills one of them. The model and a byte-level tokenizer are built here and saved to a
temporary folder that each replica loads by path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is first imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx
import pytest
import transformers as tf
from helpers.lora import peft_with_adapters
from helpers.models import build
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from paged_backend import LLM, LoRARequest, SamplingParams

ray = pytest.importorskip("ray")
from paged_backend.integrations.ray import (
    NoLiveReplicaError,
    PrefixTable,
    ReplicatedAsyncEngine,
    ReplicatedLLM,
    Router,
    start_local_ray,
)

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              # Ray Serve's own config models still use pydantic v1-style Field extras.
              pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [f"request {i}: " + "tell me about paging " * (i % 5) for i in range(48)] + \
          [[(7 * i + j) % 250 + 3 for j in range(3 + i % 29)] for i in range(16)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=4 + i % 13) for i in range(len(PROMPTS))]


# ------------------------------------------------------------------ routing, without Ray

def test_router_prefers_least_outstanding_and_alternates_on_ties():
    router = Router(3)
    assert [router.choose([1]) for _ in range(3)] == [0, 1, 2]
    router.release(1)
    assert router.choose([1]) == 1
    assert router.choose([1], exclude=[0]) in (1, 2)
    assert router.routed == [1, 2, 2]


def test_router_skips_dead_replicas_and_says_why_when_none_is_left():
    router = Router(2)
    router.mark_dead(0, "killed by ray.kill")
    assert {router.choose([5]) for _ in range(4)} == {1}
    with pytest.raises(NoLiveReplicaError, match="replica 0: killed by ray.kill.*replica 1: already tried"):
        router.choose([5], exclude=[1])


def test_prefix_aware_router_keeps_a_shared_prefix_on_one_replica_within_the_slack():
    system = list(range(40))  # two full blocks of 16, then a partial one
    router = Router(2, PrefixTable(block_size=16), balance_slack=2)
    first = router.choose(system + [100])
    other = router.choose([9] * 20)
    assert other != first
    # Same prefix: back to `first` although both have one outstanding request...
    assert [router.choose(system + [101 + i]) for i in range(3)] == [first] * 3
    # ...until `first` is more than balance_slack requests ahead: then least outstanding wins.
    assert router.choose(system + [200]) == other
    assert router.prefix_hits == 2


def test_prefix_table_matches_whole_blocks_only_and_forgets_a_replica():
    table = PrefixTable(block_size=4, capacity=100)
    table.record([1, 2, 3, 4, 5, 6, 7, 8, 9], replica=1)
    assert table.match([1, 2, 3, 4, 5, 6, 7, 8, 0]) == (1, 8)
    assert table.match([1, 2, 3, 4, 0, 6, 7, 8]) == (1, 4)
    assert table.match([0, 2, 3, 4, 5, 6, 7, 8]) == (None, 0)  # a key stands for the whole prefix
    assert table.match([1, 2, 3]) == (None, 0)
    table.forget(1)
    assert table.match([1, 2, 3, 4]) == (None, 0)
    small = PrefixTable(block_size=1, capacity=3)
    small.record([1, 2, 3, 4, 5], replica=0)
    assert len(small.owners) == 3


def test_prefix_table_and_router_keep_the_same_tokens_under_different_adapters_apart():
    tokens = list(range(1, 10))
    table = PrefixTable(block_size=4)
    table.record(tokens, replica=1, salt="lora:alpha:1")
    assert table.match(tokens) == (None, 0)  # the base model's prefix is another one
    assert table.match(tokens, salt="lora:beta:2") == (None, 0)
    assert table.match(tokens, salt="lora:alpha:1") == (1, 8)
    table.record(tokens, replica=0)
    assert table.match(tokens) == (0, 8) and table.match(tokens, salt="lora:alpha:1") == (1, 8)
    router = Router(2, PrefixTable(block_size=4), balance_slack=4)
    first = router.choose(tokens, salt="lora:alpha:1")
    assert router.choose(tokens) != first, "the base request has no cached prefix: least outstanding decides"
    assert router.choose([99] * 8) == first  # round robin: `first` is now the busier one...
    assert router.choose(tokens, salt="lora:alpha:1") == first and router.prefix_hits == 1  # ...yet holds the prefix


# ------------------------------------------------------------------ fixtures: one Ray session per module

def byte_tokenizer() -> tf.PreTrainedTokenizerFast:
    """Byte-level BPE without merges: exactly 256 tokens, matching the tiny models' vocabulary."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    build("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, num_threads=1)
    return llm, llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A PEFT model on the saved tiny Llama's architecture with adapters alpha, beta, gamma; alpha and beta
    also saved as folders."""
    model = peft_with_adapters()
    root = tmp_path_factory.mktemp("adapters")
    model.save_pretrained(root, selected_adapters=["alpha", "beta"])
    return model, {name: str(root / name) for name in ("alpha", "beta")}


LORA_PROMPTS = PROMPTS[:8]
LORAS = [None, "alpha", "beta", "alpha", "beta", None, "alpha", "beta"]


@pytest.fixture(scope="module")
def lora_reference(model_dir, adapters):
    """One engine's answers with the adapters (its equality with PEFT is tests/model/test_lora.py's)."""
    peft, folders = adapters
    llm = LLM(model_dir, num_threads=1, enable_lora=True)
    llm.add_lora("alpha", folders["alpha"])
    llm.add_lora("beta", peft, adapter_name="beta")
    outputs = llm.generate(LORA_PROMPTS, GREEDY, use_tqdm=False, lora=LORAS)
    base = llm.generate(LORA_PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b, n in zip(outputs, base, LORAS) if n), \
        "every adapter should change the answer, or the tests could not fail"
    return outputs


@pytest.fixture(scope="module")
def replicated(model_dir):
    start_local_ray(num_cpus=2)
    llm = ReplicatedLLM(model_dir, num_replicas=2, num_cpus=0.5, request_timeout_s=60, enable_lora=True, max_loras=2)
    yield llm
    llm.shutdown()
    ray.shutdown()


def same_completion(a, b) -> bool:
    x, y = a.outputs[0], b.outputs[0]
    return (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)


# ------------------------------------------------------------------ replicas

def test_two_replicas_serve_64_requests_like_one_engine(replicated, reference):
    _, expected = reference
    outputs = replicated.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(outputs) == 64 and all(o.finished and o.error is None for o in outputs)
    assert [o.prompt for o in outputs] == [e.prompt for e in expected]
    assert all(same_completion(o, e) for o, e in zip(outputs, expected))
    router = replicated.aengine.router
    assert router.outstanding == [0, 0] and min(router.routed) >= 16  # both replicas did real work
    stats = replicated.stats()
    assert stats["num_replicas_alive"] == 2 and stats["num_running"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] or stats["prefix_cache_hit_tokens"] >= 0


def test_bad_input_is_refused_before_it_reaches_a_replica(replicated):
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        replicated.generate(["fine", []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        next(replicated.stream([300], GREEDY))
    assert sum(replicated.aengine.router.outstanding) == 0


async def test_async_and_sync_streams_deliver_the_same_tokens_as_one_engine(replicated, reference):
    _, expected = reference
    aengine = replicated.aengine
    deltas, last = [], None
    async for output in aengine.generate(PROMPTS[3], PARAMS[3]):
        deltas += output.delta_token_ids
        last = output
    assert last.finished and deltas == last.outputs[0].token_ids and same_completion(last, expected[3])
    sync = list(await asyncio.to_thread(lambda: list(replicated.stream(PROMPTS[5], PARAMS[5]))))
    assert len(sync) == len(expected[5].outputs[0].token_ids) and same_completion(sync[-1], expected[5])


async def test_leaving_a_stream_early_aborts_the_request_on_its_replica(replicated):
    aengine = replicated.aengine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with contextlib.aclosing(aengine.generate("a long one", params)) as outputs:
        async for _ in outputs:
            break
    assert aengine.inflight == {} and sum(aengine.router.outstanding) == 0
    for _ in range(100):
        if aengine.stats()["num_running"] == 0:
            break
        await asyncio.sleep(0.05)
    assert aengine.stats()["num_running"] == 0


def test_the_replicated_engine_is_an_engine_client_submit_and_abort_included(replicated, reference):
    """What LangChain and the server call: submit with a sink (the same tokens as one engine), abort
    of a submitted request, the limits, and an unknown adapter refused by name; stats combine the
    replicas' hit rates."""
    import queue

    from paged_backend.entrypoints.engine_client import EngineClient

    llm, expected = reference
    aengine = replicated.aengine
    assert isinstance(aengine, EngineClient)
    assert (aengine.max_model_len, aengine.vocab_size, aengine.eos_token_ids) == \
        (llm.engine.max_model_len, llm.engine.vocab_size, llm.engine.eos_token_ids)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    aengine.submit(PROMPTS[7], PARAMS[7], None, outputs.put)
    while not (last := outputs.get(timeout=60)).finished:
        pass
    assert same_completion(last, expected[7])
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    request_id = aengine.submit("a long one", long, None, outputs.put)
    outputs.get(timeout=60)
    aengine.abort(request_id)
    while not (last := outputs.get(timeout=60)).finished:  # the sink hears how the request ended
        pass
    assert last.outputs[0].finish_reason == "abort" and last.error is None and last.outputs[0].token_ids
    # Cancelling the feeding task alone (abort's first move, racing the replica's own abort output)
    # still ends the sink's stream. On a fast machine the tiny model can deliver all its tokens before
    # the cancel lands (the stream then ends on "length", which proves nothing), so a few tries.
    for _ in range(5):
        request_id = aengine.submit("another long one", long, None, outputs.put)
        outputs.get(timeout=60)
        task = aengine.submitted.get(request_id)
        if task is not None:
            task.cancel()
        while not (last := outputs.get(timeout=60)).finished:
            pass
        assert last.request_id == request_id and last.error is None
        if last.outputs[0].finish_reason != "length":
            break
    assert last.outputs[0].finish_reason == "abort"
    for _ in range(100):
        if aengine.stats()["num_running"] == 0 and request_id not in aengine.submitted:
            break
        time.sleep(0.05)
    assert aengine.stats()["num_running"] == 0 and aengine.inflight == {}
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'german'; known adapters: none"):
        aengine.validate([5, 6], GREEDY, lora="german")
    assert aengine.list_loras() == [] and aengine.supports_lora
    stats = aengine.stats()
    queried = sum(s["prefix_cache_queried_tokens"] for s in stats["replicas"].values())
    assert queried == stats["prefix_cache_queried_tokens"] > 0
    assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hit_tokens"] / queried


def test_a_replica_streams_at_most_a_window_ahead_of_its_consumer(replicated):
    from paged_backend.integrations.ray.replica import STREAM_WINDOW

    replica = replicated.aengine.replicas[0]
    params = SamplingParams(temperature=0.0, max_tokens=4 * STREAM_WINDOW, ignore_eos=True)
    refs = replica.generate.remote("a slow reader", params, "window-test")
    first = ray.get(next(refs))
    for _ in range(200):  # the engine finishes the request whatever the consumer does...
        if ray.get(replica.stats.remote())["num_running"] == 0:
            break
        time.sleep(0.05)
    # ...but the replica's generator waits for the consumer instead of parking every output in the store.
    done, _ = ray.wait([refs.completed()], timeout=1.0)
    assert not done
    rest = [ray.get(ref) for ref in refs]
    assert len(rest) == 4 * STREAM_WINDOW - 1 and rest[-1].finished
    assert first.outputs[0].token_ids + [t for o in rest for t in o.delta_token_ids] == rest[-1].outputs[0].token_ids


async def test_prefix_aware_routing_lands_a_shared_system_prompt_where_it_is_cached(replicated):
    client = ReplicatedAsyncEngine(replicated.aengine.replicas, prefix_aware=True, request_timeout_s=60)
    systems = ["You are terse. " * 4, "You are verbose! " * 4]  # 60 and 68 bytes: 3 and 4 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for system in systems:  # one request each fills a replica's cache (round-robin: one each)
        await client.complete(system + "warm up", params)
    assert client.router.routed == [1, 1]
    owners = [client.router.prefixes.match(client.engine.tokenize(s)[1])[0] for s in systems]
    # Six questions on one system prompt, then six on the other, all at once: least outstanding alone
    # would spread each group over both replicas, and half of each group would miss the cache.
    questions = [systems[i // 6] + f"question {i}" for i in range(12)]
    outputs = await asyncio.gather(*(client.complete(q, params) for q in questions))
    assert all(o.error is None and o.num_cached_tokens >= 48 for o in outputs)
    # The first group's owner is least loaded only for its first question: 5 choices went by prefix.
    assert sorted(owners) == [0, 1] and client.router.routed == [7, 7] and client.router.prefix_hits == 5


# ------------------------------------------------------------------ LoRA adapters

def replica_loras(llm) -> list[list[str]]:
    return ray.get([r.list_loras.remote() for r in llm.aengine.replicas], timeout=30)


def test_adapters_are_added_listed_and_removed_on_every_replica_and_answer_like_one_engine(
        replicated, adapters, lora_reference):
    peft, folders = adapters
    replicated.add_lora("alpha", folders["alpha"])  # a folder travels as its path
    replicated.add_lora("beta", peft, adapter_name="beta")  # a PeftModel travels as its weights
    try:
        assert replicated.list_loras() == ["alpha", "beta"]
        assert replica_loras(replicated) == [["alpha", "beta"]] * 2
        routed = list(replicated.aengine.router.routed)
        outputs = replicated.generate(LORA_PROMPTS, GREEDY, use_tqdm=False, lora=LORAS)
        assert all(o.error is None for o in outputs)
        assert [o.outputs[0].token_ids for o in outputs] == [e.outputs[0].token_ids for e in lora_reference]
        assert all(after > before for after, before in zip(replicated.aengine.router.routed, routed))
        streamed = list(replicated.stream(LORA_PROMPTS[2], GREEDY, lora=LoRARequest("beta")))
        assert streamed[-1].outputs[0].token_ids == lora_reference[2].outputs[0].token_ids
        with pytest.raises(ValueError, match=r"prompt 1: unknown LoRA adapter 'gamma'; known adapters: "
                                             r"\['alpha', 'beta'\]"):
            replicated.generate(LORA_PROMPTS[:2], GREEDY, use_tqdm=False, lora=[None, "gamma"])
        with pytest.raises(ValueError, match="already registered"):
            replicated.add_lora("alpha", folders["beta"])
        # The replicas' engines check an adapter: refused there with their message, registered nowhere.
        dora = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
        with pytest.raises(ValueError, match="DoRA adapters"):
            replicated.add_lora("dora", dora)
        replicated.remove_lora("alpha")
        assert replicated.list_loras() == ["beta"] and replica_loras(replicated) == [["beta"]] * 2
        with pytest.raises(ValueError, match=r"no LoRA adapter named 'alpha'; known: \['beta'\]"):
            replicated.remove_lora("alpha")
    finally:
        for name in replicated.list_loras():
            replicated.remove_lora(name)
    assert replica_loras(replicated) == [[], []]


def test_a_lora_request_with_a_path_registers_on_every_replica_on_first_use(replicated, adapters, lora_reference):
    _, folders = adapters
    try:
        (output,) = replicated.generate(LORA_PROMPTS[1], GREEDY, use_tqdm=False,
                                        lora=LoRARequest("alpha", folders["alpha"]))
        assert output.outputs[0].token_ids == lora_reference[1].outputs[0].token_ids
        assert replicated.list_loras() == ["alpha"] and replica_loras(replicated) == [["alpha"]] * 2
    finally:
        replicated.remove_lora("alpha")


# ------------------------------------------------------------------ Ray Serve

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_deployment_answers_openai_requests_like_one_engine(replicated, reference, adapters, lora_reference):
    from paged_backend.integrations.ray import build_app
    from ray import serve

    llm, _ = reference
    _, folders = adapters
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(replicas=replicated.aengine.replicas, model_name="tiny",
                            lora_modules={"alpha": folders["alpha"]}, allow_runtime_lora_updating=True),
                  name="replicas", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"model": "tiny", "prompt": PROMPTS[:4], "max_tokens": 12, "temperature": 0}
            answer = http.post("/v1/completions", json=body).json()
            texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
            assert texts == [o.outputs[0].text for o in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
            streamed = http.post("/v1/completions", json=dict(body, prompt=PROMPTS[0], stream=True)).text
            assert streamed.rstrip().endswith("data: [DONE]")
            # A logit_bias is a logits processor; it travels to the replica with the request.
            forced = dict(body, prompt=PROMPTS[0], max_tokens=3, logit_bias={"65": 100})
            assert http.post("/v1/completions", json=forced).json()["choices"][0]["text"] == \
                byte_tokenizer().decode([65] * 3)
            assert "paged_backend_num_requests_running" in http.get("/metrics").text
            # LoRA adapters as on one engine's server: listed, chosen by `model`, loaded and unloaded.
            assert model_cards(http) == [("tiny", None), ("alpha", "tiny")]
            assert http.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": folders["beta"]}
                             ).status_code == 200
            assert model_cards(http) == [("tiny", None), ("alpha", "tiny"), ("beta", "tiny")]
            for i in (1, 2):
                body = {"model": LORAS[i], "prompt": LORA_PROMPTS[i], "max_tokens": 12, "temperature": 0}
                assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == \
                    lora_reference[i].outputs[0].text
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
            missing = http.post("/v1/completions", json=dict(body, model="beta"))
            assert missing.status_code == 404 and "`alpha`" in missing.json()["error"]["message"]
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 200
    finally:
        serve.shutdown()


def model_cards(http: httpx.Client) -> list[tuple[str, str | None]]:
    return [(c["id"], c.get("parent")) for c in http.get("/v1/models").json()["data"]]


# ------------------------------------------------------------------ a replica Ray restarts

async def test_a_restartable_replica_comes_back_and_reruns_what_it_lost(model_dir, reference, replicated,
                                                                          adapters, lora_reference):
    """...and gets back the adapters registered before it died (it reads one when a request names it)."""
    llm, _ = reference
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)
    restartable = ReplicatedLLM(model_dir, num_replicas=1, num_cpus=0.5, max_restarts=1, request_timeout_s=60,
                                enable_lora=True)
    try:
        client = restartable.aengine
        await asyncio.to_thread(restartable.add_lora, "beta", adapters[0], "beta")
        replica = client.replicas[0]
        first_pid = (await asyncio.to_thread(ray.get, replica.describe.remote())).pid
        batch = asyncio.ensure_future(client.run_batch(prompts, [params] * len(prompts)))
        while not client.inflight:  # 200 tokens each: all four are still running when the process dies
            await asyncio.sleep(0.01)
        ray.kill(replica, no_restart=False)  # the process dies as in a crash; Ray may restart it
        outputs = await asyncio.wait_for(batch, 90)
        # With one replica there is nowhere else to go: the retries ran on the restarted process.
        assert client.num_retries > 0 and all(o.error is None for o in outputs)
        assert all(same_completion(o, e) for o, e in zip(outputs, expected))
        assert (await asyncio.to_thread(ray.get, replica.describe.remote())).pid != first_pid
        assert client.router.alive == [True] and client.is_alive()
        assert await asyncio.to_thread(ray.get, replica.list_loras.remote()) == []  # a fresh process...
        again = await client.complete(LORA_PROMPTS[2], GREEDY, lora="beta")  # ...reads the adapter on first use
        assert again.error is None and again.outputs[0].token_ids == lora_reference[2].outputs[0].token_ids
        assert await asyncio.to_thread(ray.get, replica.list_loras.remote()) == ["beta"]
    finally:
        restartable.shutdown()


# ------------------------------------------------------------------ a replica dies mid-run (keep last)

async def test_a_killed_replica_has_its_requests_retried_or_failed_clearly(replicated, reference):
    _, expected = reference
    client = ReplicatedAsyncEngine(replicated.aengine.replicas, request_timeout_s=60)
    batch = asyncio.ensure_future(client.run_batch(PROMPTS, PARAMS))
    victim_stream = client.generate("stream me", SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    streamed = []
    async for output in victim_stream:
        streamed.append(output)
        if len(streamed) == 3:  # pause the stream (the replica stays a window ahead) while the batch runs on
            victim = client.inflight[output.request_id]
            await asyncio.to_thread(kill_and_wait, client.replicas[victim])
    outputs = await asyncio.wait_for(batch, 60)
    # The batch: every request whose replica died before answering was rerun on the survivor.
    assert client.num_retries > 0 and client.router.alive.count(True) == 1
    assert all(o.error is None for o in outputs) and all(same_completion(o, e) for o, e in zip(outputs, expected))
    # The stream had already delivered tokens: it ends at once with a finished output naming the cause.
    final = streamed[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert "killed by `ray.kill`" in final.error and "not retried" in final.error
    assert len(final.outputs[0].token_ids) >= 3
    # With every replica dead, a request fails at once with the reasons, rather than waiting.
    ray.kill(client.replicas[1 - victim])
    lost = await asyncio.wait_for(client.complete(PROMPTS[0], GREEDY), 30)
    assert lost.finished and lost.error.startswith("no live replica left") and "ray.kill" in lost.error


def kill_and_wait(replica) -> None:
    """Kill an actor and return once Ray reports it dead, so nothing it still had in hand can finish."""
    ray.kill(replica)
    for _ in range(600):
        try:
            ray.get(replica.stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed replica still answers")
