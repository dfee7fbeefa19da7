"""The server's life: 503 until the model has loaded, then serving; on SIGTERM no new requests, those in flight
finished or, past the drain timeout, aborted with a last event each; then the process exits, nothing leaked."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from helpers.server import KEY, build_chat_tokenizer, running, tiny_llama, wait_all_blocks_free
from paged_backend.integrations.server import create_app
from paged_backend.integrations.server.lifecycle import DrainingServer, Lifecycle, TrackedClient

from paged_backend import LLM, AsyncEngine

pytestmark = pytest.mark.timeout(180)

HEADERS = {"Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def lifecycle_server(drain_timeout: float) -> Iterator[tuple[str, Lifecycle, DrainingServer]]:
    """A DrainingServer in a thread on a free port, its model not yet loaded."""
    lifecycle = Lifecycle(drain_timeout)
    server = DrainingServer(uvicorn.Config(lifecycle, log_level="warning"), lifecycle)
    with running(server) as url:
        yield url, lifecycle, server


@pytest.fixture(scope="module")
def llm() -> LLM:
    tokenizer = build_chat_tokenizer(["tell me about rivers and bridges"] * 3)
    return LLM(tiny_llama(tokenizer), tokenizer, num_kv_blocks=256, compile=False)


def load(lifecycle: Lifecycle, llm: LLM) -> AsyncEngine:
    aengine = AsyncEngine(llm.engine)
    client = TrackedClient(aengine)
    lifecycle.serve(create_app(client, "tiny", KEY), client)
    return aengine


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def stream_completion(url: str, max_tokens: int) -> list[dict]:
    """A streamed completion's events, [DONE] as None."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_every_route_answers_503_until_the_model_has_loaded(llm: LLM) -> None:
    with lifecycle_server(5.0) as (url, lifecycle, _):
        assert httpx.get(f"{url}/health").status_code == 503
        loading = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=HEADERS)
        assert loading.status_code == 503 and loading.headers["retry-after"] == "5"
        assert loading.json()["error"]["message"] == "the model is still loading"
        aengine = load(lifecycle, llm)
        try:
            assert httpx.get(f"{url}/health").status_code == 200
            answer = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2},
                                headers=HEADERS)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        finally:
            aengine.shutdown()


def test_a_drain_finishes_requests_in_flight_and_refuses_new_ones(llm: LLM) -> None:
    with lifecycle_server(30.0) as (url, lifecycle, server):
        aengine = load(lifecycle, llm)
        try:
            with ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(stream_completion, url, 300) for _ in range(4)]
                wait_until(lambda: lifecycle.in_flight == 4)
                server.handle_exit(signal.SIGTERM, None)
                wait_until(lambda: lifecycle.draining)
                assert httpx.get(f"{url}/health").status_code == 503
                refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=HEADERS)
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
                assert httpx.get(f"{url}/metrics").status_code == 200  # scrapes still answered
                for stream in streams:
                    events = stream.result()
                    assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "length"
            wait_until(lambda: server.should_exit)
            wait_all_blocks_free(aengine)
        finally:
            aengine.shutdown()


def test_past_the_drain_timeout_requests_are_aborted_each_with_a_last_event(llm: LLM) -> None:
    with lifecycle_server(0.1) as (url, lifecycle, server):
        aengine = load(lifecycle, llm)
        try:
            with ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(stream_completion, url, 1000) for _ in range(4)]
                wait_until(lambda: lifecycle.in_flight == 4)
                server.handle_exit(signal.SIGTERM, None)
                for stream in streams:
                    events = stream.result()
                    assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] == "abort"
            wait_all_blocks_free(aengine)
            assert not lifecycle.client.running
        finally:
            aengine.shutdown()


@pytest.mark.slow  # a serve process, stopped by a signal: the slow tier
def test_sigterm_drains_the_serve_process_which_exits_cleanly() -> None:
    """`paged-backend serve` on the default model: /health is 503 while it loads, then 200; SIGTERM during 32
    streams ends each with its last event and [DONE], and the process exits 0 within the drain timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "paged_backend.integrations.server", "--port", str(port), "--api-key", KEY,
               "--served-model-name", "tiny", "--no-compile", "--drain-timeout", "1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None and statuses[-1:] != [200]:
            with contextlib.suppress(httpx.HTTPError):
                statuses.append(httpx.get(f"{url}/health", timeout=1).status_code)
            time.sleep(0.1)
        assert statuses[-1] == 200 and 503 in statuses  # bound and answering before the model was ready
        with ThreadPoolExecutor(32) as pool:
            streams = [pool.submit(stream_completion, url, 2000) for _ in range(32)]
            time.sleep(2)  # every stream admitted and generating
            started = time.time()
            process.send_signal(signal.SIGTERM)
            for stream in streams:
                events = stream.result()
                assert events[-1] is None and events[-2]["choices"][0]["finish_reason"] in ("abort", "length")
        assert process.wait(timeout=30) == 0
        assert time.time() - started < 1 + 5 + 10  # the drain timeout, the abort grace, the engine's shutdown
    finally:
        if process.poll() is None:
            process.kill()
        stderr = process.communicate()[1]
    assert "aborted" in stderr and "Traceback" not in stderr
