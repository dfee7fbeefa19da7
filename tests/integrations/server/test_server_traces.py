"""Traces through the server (route_spans.py and paged_backend/tracing.py): a route's span continues the
client's W3C traceparent, is named after the route's template, lasts until a stream's last byte and is the
parent of the engine spans of the requests it submitted; a structured request's wait for its grammar is a
span of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.server import KEY, Served, build_chat_tokenizer, serve, tiny_llama
from helpers.traces import children, covered, recording, request_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from paged_backend import LLM

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
HEADERS = {"Authorization": f"Bearer {KEY}", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[Served, InMemorySpanExporter]]:
    tokenizer = build_chat_tokenizer(["tell me about rivers and bridges", '{"a": 1}'] * 3)
    with recording() as exporter, serve(LLM(tiny_llama(tokenizer), tokenizer, num_kv_blocks=64, compile=False),
                                        "tiny") as served:
        yield served, exporter


def route_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    """The route's span, once the server has ended it (just after the client read the last byte)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = [s for s in exporter.get_finished_spans() if s.name == name]
        if found:
            return found[-1]
        time.sleep(0.02)
    raise AssertionError(f"no span {name!r}")


def test_a_streamed_chat_continues_the_clients_trace_through_the_route_into_the_engine(traced) -> None:
    served, exporter = traced
    exporter.clear()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about rivers"}], "max_tokens": 4,
            "stream": True, "n": 2}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", headers=HEADERS, json=body) as answer:
        assert answer.status_code == 200
        lines = list(answer.iter_lines())
    assert "data: [DONE]" in lines
    route = route_span(exporter, "POST /v1/chat/completions")
    assert format(route.context.trace_id, "032x") == TRACE_ID and format(route.parent.span_id, "016x") == CLIENT_SPAN
    assert route.attributes["http.route"] == "/v1/chat/completions"
    assert route.attributes["http.response.status_code"] == 200
    (engine,) = request_spans(exporter.get_finished_spans())
    assert engine.parent.span_id == route.context.span_id and engine.context.trace_id == route.context.trace_id
    assert engine.attributes["gen_ai.request.choice.count"] == 2
    assert route.start_time <= engine.start_time and engine.end_time <= route.end_time
    assert covered(engine, children(exporter.get_finished_spans(), engine)) >= 0.95


def test_a_structured_request_shows_its_wait_for_the_grammar(traced) -> None:
    served, exporter = traced
    exporter.clear()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about rivers"}], "max_tokens": 6,
            "response_format": {"type": "json_object"}}
    assert httpx.post(f"{served.url}/v1/chat/completions", headers=HEADERS, json=body).status_code == 200
    route_span(exporter, "POST /v1/chat/completions")
    (engine,) = request_spans(exporter.get_finished_spans())
    kids = children(exporter.get_finished_spans(), engine)
    assert [k.name for k in kids][:2] == ["grammar", "queue"] and kids[0].end_time == kids[1].start_time
    assert covered(engine, kids) >= 0.95


def test_a_malformed_traceparent_starts_a_trace_of_its_own(traced) -> None:
    served, exporter = traced
    exporter.clear()
    headers = HEADERS | {"traceparent": "00-not-a-trace-id-01"}
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    assert httpx.post(f"{served.url}/v1/completions", headers=headers, json=body).status_code == 200
    route = route_span(exporter, "POST /v1/completions")
    assert route.parent is None and format(route.context.trace_id, "032x") != TRACE_ID


def test_a_route_without_a_template_keeps_its_path_and_error_status(traced) -> None:
    served, exporter = traced
    exporter.clear()
    assert httpx.get(f"{served.url}/v1/nothing-here", headers=HEADERS).status_code == 404
    span = route_span(exporter, "GET /v1/nothing-here")
    assert span.attributes["http.response.status_code"] == 404 and "http.route" not in span.attributes


def test_an_embedding_request_is_an_embeddings_span(traced) -> None:
    served, exporter = traced
    exporter.clear()
    body = {"model": "tiny", "input": "tell me about rivers"}
    assert httpx.post(f"{served.url}/v1/embeddings", headers=HEADERS, json=body).status_code == 200
    route = route_span(exporter, "POST /v1/embeddings")
    (engine,) = request_spans(exporter.get_finished_spans())
    assert engine.name == "embeddings LlamaForCausalLM" and engine.parent.span_id == route.context.span_id
    assert [k.name for k in children(exporter.get_finished_spans(), engine)] == ["queue", "prefill"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == 0
