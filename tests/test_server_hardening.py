"""The server against what real clients send: malformed requests (each a 400 naming its field, never a
500 or a reset connection), keep-alive after errors, and client disconnects.

One server for the module: a random two-layer Llama with a tiny byte-level BPE tokenizer and a ChatML
template, on a free port of 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import Served, build_chat_tokenizer, parse_metrics, serve, tiny_llama, wait_all_blocks_free

from paged_backend import LLM

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tokenizer = build_chat_tokenizer(["Say hello.", "The weather in Paris is mild today."] * 3)
    with serve(LLM(tiny_llama(tokenizer), tokenizer, num_kv_blocks=128), "tiny") as server:
        yield server


def forced_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


class Connection:
    """One keep-alive HTTP/1.1 connection; `post` fails if the server closed it after the last answer."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path: str, body: dict[str, Any] | bytes) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = response.read()
        assert not response.will_close, "the server closed the keep-alive connection"
        assert self.conn.sock is self.sock, "the request went out on a new connection"
        try:
            return response.status, json.loads(payload)
        except json.JSONDecodeError:
            return response.status, payload.decode(errors="replace")

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def connection(served: Served) -> Iterator[Connection]:
    conn = Connection(served.url)
    yield conn
    conn.close()


GOOD_CHAT = {"model": "tiny", "messages": HELLO, "max_tokens": 2, "temperature": 0}

# What a client once got a bare 500 (and a reset connection) for, and the field the 400 must name.
MALFORMED_CHATS = [
    pytest.param(forced_tool({"type": "object", "properties": ["a"]}), "tools", id="tool-properties-list"),
    pytest.param(forced_tool({"type": "object", "properties": {"a": {"enum": []}}}), "tools", id="empty-enum"),
    pytest.param(schema_format({"type": "object", "properties": "oops"}), "response_format",
                 id="schema-properties-string"),
    pytest.param(schema_format({"type": "object", "properties": {"a": True}}), "response_format",
                 id="boolean-subschema"),
    pytest.param(schema_format("not a schema"), "response_format", id="schema-a-string"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format",
                 id="json_schema-a-string"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "oops"}]},
                 "messages", id="tool_calls-a-string"),
    pytest.param({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": 5}}]}]},
                 "messages", id="tool_call-arguments-a-number"),
    pytest.param({"seed": 2**64}, "seed", id="seed-2**64"),
    pytest.param({"seed": 10**30}, "seed", id="seed-10**30"),
    pytest.param({"seed": -(2**63) - 1}, "seed", id="seed-below-int64"),
]


@pytest.mark.parametrize("change, param", MALFORMED_CHATS)
def test_malformed_chat_is_a_400_and_the_connection_stays_usable(connection: Connection, change: dict,
                                                                 param: str) -> None:
    status, body = connection.post("/v1/chat/completions", GOOD_CHAT | change)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    status, body = connection.post("/v1/chat/completions", GOOD_CHAT)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2**64}),
    ("/generate", {"prompt": "hi", "seed": 2**64}),
    ("/generate", {"prompt": "hi", "seed": -(2**63) - 1}),
])
def test_out_of_range_seeds_are_400_on_every_route(connection: Connection, path: str, body: dict) -> None:
    status, answer = connection.post(path, body)
    assert status == 400 and answer["error"]["param"] == "seed", answer


def test_extreme_in_range_seeds_work_for_every_sample(connection: Connection) -> None:
    for seed in (2**63 - 1, -(2**63)):
        status, body = connection.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                           "n": 3, "seed": seed})
        assert status == 200 and len(body["choices"]) == 3, body


def test_an_unexpected_handler_error_is_a_json_500_on_a_kept_connection(served: Served, connection: Connection,
                                                                         monkeypatch) -> None:
    from paged_backend.integrations.server import completions

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the handler")

    monkeypatch.setattr(completions, "prompt_list", broken)
    status, body = connection.post("/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert status == 500 and body["error"]["type"] == "internal_error"
    assert "a bug in the handler" in body["error"]["message"]
    monkeypatch.undo()
    status, body = connection.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    metrics = parse_metrics(httpx.get(f"{served.url}/metrics").text)
    assert metrics['paged_backend_http_requests_total{path="/v1/completions",status="500"}'] >= 1


def test_malformed_json_then_a_good_request_on_the_same_connection(connection: Connection) -> None:
    status, body = connection.post("/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert connection.post("/v1/chat/completions", GOOD_CHAT)[0] == 200


def test_a_plain_request_whose_client_hangs_up_counts_as_499(served: Served, caplog) -> None:
    def count(status: str) -> float:
        metrics = parse_metrics(httpx.get(f"{served.url}/metrics").text)
        return metrics.get(f'paged_backend_http_requests_total{{path="/v1/completions",status="{status}"}}', 0.0)

    before_499, before_500 = count("499"), count("500")
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 1000 tokens are done
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=0.5)
    wait_all_blocks_free(served.aengine)
    deadline = time.time() + 10
    while count("499") == before_499 and time.time() < deadline:
        time.sleep(0.1)
    assert count("499") == before_499 + 1 and count("500") == before_500
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a traceback was logged"
