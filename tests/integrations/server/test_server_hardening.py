"""The server against what real clients send: guidellm's and lm-eval's exact request bodies, malformed
requests (each a 400 naming its field, never a 500 or a reset connection), keep-alive after errors,
client disconnects, and a schemathesis fuzz of every route from the server's own OpenAPI schema.

Servers: a random two-layer Llama with a tiny byte-level BPE tokenizer and a ChatML template, on a
free port of 127.0.0.1 (the fuzz gets its own, with a short context so every answer stays short).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
import torch
from helpers.server import (
    Served,
    build_chat_tokenizer,
    parse_metrics,
    serve,
    tiny_llama,
    wait_all_blocks_free,
)
from helpers.tolerances import approx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from paged_backend.integrations.server.protocol import (
    CHAT_NEUTRAL_FIELDS,
    NEUTRAL_FIELDS,
)

from paged_backend import LLM, BeamSearchParams

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Say hello."}]


CORPUS = ["Say hello.", "The weather in Paris is mild today.", "Question: what is two plus two?\nAnswer: four"]


@pytest.fixture(scope="module")
def parts() -> tuple[Any, Any]:
    tokenizer = build_chat_tokenizer(CORPUS * 3)
    return tiny_llama(tokenizer), tokenizer


@pytest.fixture(scope="module")
def served(parts) -> Iterator[Served]:
    model, tokenizer = parts
    with serve(LLM(model, tokenizer, num_kv_blocks=128), "tiny") as server:
        yield server


def forced_tool(parameters: dict[str, Any], tool_choice: str = "required") -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": tool_choice}


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
    pytest.param(forced_tool({"type": "object", "properties": ["a"]}), "tools.0.function.parameters",
                 id="tool-properties-list"),
    pytest.param(forced_tool({"type": "object", "properties": {"a": {"enum": []}}}), "tools.0.function.parameters",
                 id="empty-enum"),
    # Not forced: the schema never becomes a grammar, but a call the model writes is read against it.
    pytest.param(forced_tool({"type": "objct"}, "auto"), "tools.0.function.parameters", id="auto-unknown-type"),
    pytest.param(schema_format({"type": "object", "properties": "oops"}), "response_format",
                 id="schema-properties-string"),
    pytest.param(schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}), "response_format",
                 id="unknown-type"),
    pytest.param(schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}),
                 "response_format", id="dangling-ref"),
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


def completions_answered(served: Served, status: str) -> float:
    metrics = parse_metrics(httpx.get(f"{served.url}/metrics").text)
    return metrics.get(f'paged_backend_http_requests_total{{path="/v1/completions",status="{status}"}}', 0.0)


def test_a_plain_request_whose_client_hangs_up_counts_as_499(served: Served, caplog) -> None:
    def count(status: str) -> float:
        return completions_answered(served, status)

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


def test_a_stream_whose_client_hangs_up_counts_as_499(served: Served, caplog) -> None:
    """A stream has sent its 200 before the client leaves; the count says the client left, as for a plain request."""
    before_499, before_200 = completions_answered(served, "499"), completions_answered(served, "200")
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert next(response.iter_lines()).startswith("data: ")  # one event, then the client hangs up
    wait_all_blocks_free(served.aengine)
    deadline = time.time() + 10
    while completions_answered(served, "499") == before_499 and time.time() < deadline:
        time.sleep(0.1)
    assert completions_answered(served, "499") == before_499 + 1
    assert completions_answered(served, "200") == before_200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a traceback was logged"


def test_a_stream_that_fails_midway_ends_cleanly_on_a_kept_connection(connection: Connection, monkeypatch) -> None:
    from paged_backend.integrations.server import completions

    def broken(*args, **kwargs):
        raise RuntimeError("a bug while streaming")

    monkeypatch.setattr(completions, "stream_choice", broken)
    status, body = connection.post("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": True})
    assert status == 200 and "[DONE]" not in body  # the stream had started; it ends early but well-formed
    monkeypatch.undo()
    assert connection.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


# ------------------------------------------------------------------ real clients' request bodies

def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def guidellm_body(kind: str, stream: bool, output_tokens: int = 6) -> dict[str, Any]:
    """What guidellm's OpenAI HTTP backend sends for a request with a fixed output length."""
    body: dict[str, Any] = {"model": "tiny"}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if kind == "chat":
        body |= {"max_completion_tokens": output_tokens, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": CORPUS[1]}]}]}
    else:
        body |= {"max_tokens": output_tokens, "stop": None, "ignore_eos": True, "prompt": CORPUS[1]}
    return body


@pytest.mark.parametrize("kind, path", [("chat", "/v1/chat/completions"), ("text", "/v1/completions")])
def test_guidellm_streams_carry_usage_in_every_chunk(served: Served, kind: str, path: str) -> None:
    response = httpx.post(f"{served.url}{path}", json=guidellm_body(kind, stream=True), timeout=60)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert all("usage" in event for event in events)
    counts = [event["usage"]["completion_tokens"] for event in events]
    assert counts == sorted(counts) and counts[-1] == 6
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["prompt_tokens"] > 0
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 6
    plain = httpx.post(f"{served.url}{path}", json=guidellm_body(kind, stream=False), timeout=60).json()
    assert plain["usage"]["completion_tokens"] == 6
    # The same bodies made greedy: the stream's text is the plain answer's.
    greedy = {"temperature": 0}
    events = sse_events(httpx.post(f"{served.url}{path}", json=guidellm_body(kind, stream=True) | greedy, timeout=60))
    text = "".join((e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text") or "")
                   for e in events if e["choices"])
    plain = httpx.post(f"{served.url}{path}", json=guidellm_body(kind, stream=False) | greedy, timeout=60).json()
    assert text == (plain["choices"][0]["message"]["content"] if kind == "chat" else plain["choices"][0]["text"])


def test_usage_only_at_the_end_without_continuous_usage_stats(served: Served) -> None:
    body = guidellm_body("text", stream=True) | {"stream_options": {"include_usage": True}}
    events = sse_events(httpx.post(f"{served.url}/v1/completions", json=body, timeout=60))
    assert [bool(e.get("usage")) for e in events] == [False] * (len(events) - 1) + [True]


def test_guided_stream_carries_continuous_usage(served: Served) -> None:
    body = guidellm_body("chat", stream=True) | {"response_format": {"type": "json_object"}}
    del body["ignore_eos"]
    events = sse_events(httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60))
    assert all("usage" in event for event in events)
    assert events[-1]["usage"]["completion_tokens"] > 0


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def test_lm_eval_loglikelihood_batch_scores_match_the_model(served: Served, parts) -> None:
    """lm-eval `local-completions` loglikelihood: token-id prompts in one batch, echo + logprobs 1."""
    model, tokenizer = parts
    batch = [prompt_ids(tokenizer, text) for text in CORPUS]
    body = {"model": "tiny", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    for choice, ids in zip(sorted(answer["choices"], key=lambda c: c["index"]), batch):
        scored = choice["logprobs"]
        assert len(scored["token_logprobs"]) == len(ids) + 1 and scored["token_logprobs"][0] is None
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        want = [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert scored["token_logprobs"][1:len(ids)] == approx(want)
        # lm-eval's greedy check: each position's top-1 alternative against the token's own logprob
        for own, top in zip(scored["token_logprobs"][1:], scored["top_logprobs"][1:]):
            assert len(top) == 1 and max(top.values()) >= own - 1e-6


def test_lm_eval_generate_bodies(served: Served, parts) -> None:
    _, tokenizer = parts
    batch = [prompt_ids(tokenizer, text) for text in CORPUS[:2]]
    completion = {"prompt": batch, "model": "tiny", "max_tokens": 8, "temperature": 0, "stop": ["\n\n", "Question:"],
                  "seed": 1234}
    answer = httpx.post(f"{served.url}/v1/completions", json=completion, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
    text_prompts = completion | {"prompt": CORPUS[:2]}
    assert [c["text"] for c in httpx.post(f"{served.url}/v1/completions", json=text_prompts, timeout=60)
            .json()["choices"]] == [c["text"] for c in answer.json()["choices"]]
    chat = {"messages": [{"role": "user", "content": CORPUS[2]}], "model": "tiny", "max_tokens": 8, "temperature": 0,
            "stop": ["<|im_end|>"], "seed": 1234}
    reply = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60)
    assert reply.status_code == 200 and isinstance(reply.json()["choices"][0]["message"]["content"], str)


def test_lm_eval_remote_tokenizer_probe(served: Served, parts) -> None:
    """What lm-eval checks before using the server's tokenizer: /tokenizer_info, then /tokenize."""
    _, tokenizer = parts
    info = httpx.get(f"{served.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tokenizer.chat_template
    tokens = httpx.post(f"{served.url}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert tokens["tokens"] == tokenizer("test", add_special_tokens=False)["input_ids"]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == served.aengine.engine.max_model_len
    eos = httpx.post(f"{served.url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"][0] == tokenizer.eos_token_id
    ids = prompt_ids(tokenizer, CORPUS[1])
    assert httpx.post(f"{served.url}/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}


def test_tokenize_a_chat_and_return_token_strings(served: Served, parts) -> None:
    _, tokenizer = parts
    body = {"model": "tiny", "messages": HELLO, "return_token_strs": True}
    answer = httpx.post(f"{served.url}/tokenize", json=body).json()
    expected = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert answer["tokens"] == list(expected)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(list(expected))


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ("/tokenize", {"prompt": 5}, "prompt"),
])
def test_tokenizer_routes_refuse_bad_input(connection: Connection, path: str, body: dict, param: str) -> None:
    status, answer = connection.post(path, body)
    assert status in (400, 404) and answer["error"]["param"] == param


@pytest.mark.parametrize("logprobs, echo", [(2, False), (1, True)])
def test_streamed_completion_logprobs_have_the_plain_text_offsets(served: Served, logprobs: int, echo: bool) -> None:
    body = {"model": "tiny", "prompt": CORPUS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": logprobs, "echo": echo}
    plain = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    events = sse_events(httpx.post(f"{served.url}/v1/completions", json=body | {"stream": True}, timeout=60))
    streamed: dict[str, list] = {key: [] for key in plain}
    for event in events:
        for key in plain:
            streamed[key] += (event["choices"][0]["logprobs"] or {}).get(key, [])
    assert streamed["text_offset"] == plain["text_offset"] and streamed["tokens"] == plain["tokens"]
    assert plain["text_offset"] == sorted(plain["text_offset"]) and len(set(plain["text_offset"])) > 1


# ------------------------------------------------------------------ types, fields, limits

@pytest.mark.parametrize("path, change, param", [
    ("/v1/completions", {"max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"max_tokens": 4.0}, "max_tokens"),
    ("/v1/chat/completions", {"stream": "true"}, "stream"),
    ("/v1/chat/completions", {"max_completion_tokens": "10"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"priority": 1}, "priority"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"guided_json": {"type": "objec"}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "(a"}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/chat/completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ("/v1/chat/completions", {"guided_json": {}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/chat/completions", {"stop": 5}, "stop"),
])
def test_strict_types_and_refused_fields_are_400s_naming_the_field(connection: Connection, path: str, change: dict,
                                                                    param: str) -> None:
    base = {"model": "tiny", "max_tokens": 2} | ({"messages": HELLO} if "chat" in path else {"prompt": "hi"})
    status, answer = connection.post(path, base | change)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_vllm_fields_at_their_neutral_values_are_accepted(served: Served) -> None:
    neutral = {name: values[0] for name, (values, _) in NEUTRAL_FIELDS.items()}
    chat_neutral = {name: values[0] for name, (values, _) in CHAT_NEUTRAL_FIELDS.items()}
    chat = {"model": "tiny", "messages": HELLO, "max_tokens": 2} | neutral | chat_neutral
    assert httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    text = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "add_special_tokens": True} | neutral
    assert httpx.post(f"{served.url}/v1/completions", json=text, timeout=60).status_code == 200


def test_sequences_per_request_are_limited_with_the_numbers(connection: Connection) -> None:
    status, answer = connection.post("/v1/completions", {"model": "tiny", "prompt": ["hi"] * 200, "n": 64})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert "12800 sequences (200 prompt(s) x 64 each)" in answer["error"]["message"]
    assert "at most 256 per request (--max-seqs-per-request)" in answer["error"]["message"]
    status, answer = connection.post("/v1/completions", {"model": "tiny", "prompt": ["hi"] * 4, "n": 64,
                                                         "max_tokens": 1})
    assert status == 200 and len(answer["choices"]) == 256


@pytest.mark.parametrize("change, param", [
    ({"top_k": -5}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
])
def test_generate_names_the_sampling_field_it_refuses(connection: Connection, change: dict, param: str) -> None:
    status, answer = connection.post("/generate", {"prompt": "hi", "max_tokens": 2} | change)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_generate_beam_search_returns_the_offline_search_beams(served: Served, parts) -> None:
    model, tokenizer = parts
    body = {"prompt": CORPUS[1], "use_beam_search": True, "best_of": 3, "n": 2, "max_tokens": 6,
            "length_penalty": 0.5}
    answer = httpx.post(f"{served.url}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    offline = LLM(model, tokenizer, num_kv_blocks=64).beam_search(
        [CORPUS[1]], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))[0].sequences
    assert answer.json()["text"] == [CORPUS[1] + seq.text for seq in offline[:2]]
    wait_all_blocks_free(served.aengine)


@pytest.mark.parametrize("change, param", [
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"n": 4, "best_of": 2}, "n"),
    ({"top_p": 0.5}, "top_p"),
    ({"max_tokens": "6"}, "max_tokens"),
    ({"early_stopping": "soon"}, "early_stopping"),
    ({"best_of": 1000}, "best_of"),
])
def test_generate_beam_search_refuses_what_it_cannot_honour(connection: Connection, change: dict, param: str) -> None:
    status, answer = connection.post("/generate", {"prompt": "hi", "use_beam_search": True} | change)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_the_serving_benchmark_runs_against_the_server(served: Served) -> None:
    """benchmarks/serve.py's load loop (streaming chats, usage at the end) completes every request."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import serve as serve_benchmark

    args = argparse.Namespace(model_name="tiny", max_tokens=4, seed=0)
    row = asyncio.run(serve_benchmark.run_rate(served.url, args, CORPUS, math.inf, 1))
    assert row["completed"] == len(CORPUS) and row["failed"] == 0 and row["output_tokens_per_s"] > 0


# ------------------------------------------------------------------ property-based fuzz of every route

FUZZ_EXAMPLES = 30  # per route and mode: about 35 s in all on a 2-core machine at load 8
NEUTRAL_ONLY = set(NEUTRAL_FIELDS) | set(CHAT_NEUTRAL_FIELDS) | {"add_special_tokens"}


def fuzz(operation: Any, mode: schemathesis.GenerationMode, url: str, session: requests.Session,
         failures: list[str]) -> None:
    """Call one route with FUZZ_EXAMPLES drawn requests; note every 5xx in `failures`."""
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def call(case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # else almost every case stops at the 404 for the model
            if mode == schemathesis.GenerationMode.POSITIVE:  # let valid cases reach generation
                for name in NEUTRAL_ONLY:
                    case.body.pop(name, None)
        response = case.call(base_url=url, session=session, timeout=60)
        if response.status_code >= 500:
            failures.append(f"{operation.label} {response.status_code} {case.body!r:.300} {response.text:.300}")

    try:
        call()
    except Unsatisfiable:  # a route without parameters has no invalid request to draw
        assert mode == schemathesis.GenerationMode.NEGATIVE


@pytest.fixture(scope="module")
def fuzzed(parts) -> Iterator[Served]:
    """A server whose context is short, so even a fuzzed request for 64 choices finishes in moments."""
    model, tokenizer = parts
    with serve(LLM(model, tokenizer, num_kv_blocks=128, max_model_len=96), "tiny") as server:
        yield server


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
def test_fuzz_every_route_from_the_openapi_schema(fuzzed: Served) -> None:
    """schemathesis draws bodies from the server's own OpenAPI schema (valid ones, and ones that break
    it), with a fixed seed and a bounded number of examples, over one keep-alive session on loopback:
    no answer may be a 5xx, no connection may be dropped, and the server answers afterwards."""
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    session = requests.Session()  # a dropped keep-alive connection would surface as an exception here
    failures: list[str] = []
    for result in schema.get_all_operations():
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            fuzz(result.ok(), mode, fuzzed.url, session, failures)
    assert not failures, failures[:5]
    assert session.get(f"{fuzzed.url}/health", timeout=10).status_code == 200
    assert session.post(f"{fuzzed.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                        timeout=60).status_code == 200
    wait_all_blocks_free(fuzzed.aengine)
