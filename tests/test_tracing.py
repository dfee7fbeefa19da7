"""OpenTelemetry traces of requests (paged_backend/tracing.py): each request's span continues its caller's,
its children tile its time (queue, prefill chunks, decode), preemptions are marked, the span crosses from
the submitting thread to the engine's, and with no tracer provider nothing is recorded. The last test runs
the real global set-up, `export_otlp`, against an OTLP/HTTP collector in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.server import build_chat_tokenizer, tiny_llama
from helpers.traces import children, covered, recording, request_spans
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult
from paged_backend.integrations.langchain import ChatPaged

from paged_backend import LLM, AsyncEngine, SamplingParams, tracing

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(["tell me about rivers and bridges"] * 3)


def tiny_llm(tokenizer, **config) -> LLM:
    return LLM(tiny_llama(tokenizer), tokenizer, compile=False, **config)


def test_a_request_span_is_tiled_by_its_queue_prefill_chunks_and_decode(tokenizer) -> None:
    llm = tiny_llm(tokenizer, num_kv_blocks=64, max_num_batched_tokens=8)
    with recording() as exporter, tracing.tracer().start_as_current_span("caller") as caller:
        llm.generate([list(range(5, 25)), [6, 7, 8]], SamplingParams(max_tokens=5, ignore_eos=True))
    spans = exporter.get_finished_spans()
    long, short = request_spans(spans)
    assert long.name == "text_completion LlamaForCausalLM" and long.parent.span_id == caller.get_span_context().span_id
    kids = children(spans, long)
    assert [k.name for k in kids] == ["queue", "prefill", "prefill", "prefill", "decode"]
    assert [(k.attributes["paged_backend.chunk.position"], k.attributes["paged_backend.chunk.tokens"])
            for k in kids if k.name == "prefill"] == [(0, 8), (8, 8), (16, 4)]
    assert covered(long, kids) >= 0.95
    assert long.attributes["gen_ai.usage.input_tokens"] == 20 and long.attributes["gen_ai.usage.output_tokens"] == 5
    assert long.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert long.attributes["gen_ai.request.max_tokens"] == 5
    assert [e.name for e in long.events] == ["first_token"]
    # The short prompt waited two steps for room in the 8-token budget: its queue ends where its chunk starts.
    queue, prefill, decode = children(spans, short)
    assert (queue.name, prefill.name, decode.name) == ("queue", "prefill", "decode")
    assert queue.end_time == prefill.start_time > kids[2].start_time
    assert covered(short, [queue, prefill, decode]) >= 0.95


def test_a_preempted_request_is_marked_queued_again_and_recomputed(tokenizer) -> None:
    llm = tiny_llm(tokenizer, num_kv_blocks=12, block_size=4, max_num_batched_tokens=24)
    with recording() as exporter:
        outputs = llm.generate([[5 + i] * 10 for i in range(4)], SamplingParams(max_tokens=20, ignore_eos=True))
    preempted = [o for o in outputs if o.metrics.num_preemptions]
    assert preempted
    spans = exporter.get_finished_spans()
    for span in request_spans(spans):
        count = span.attributes["paged_backend.request.preemptions"]
        assert [e.name for e in span.events].count("preempted") == count
        kids = children(spans, span)
        assert [k.name for k in kids].count("queue") == 1 + count
        moments = [e.timestamp for e in span.events if e.name == "preempted"]
        # After each preemption a chunk recomputes the context (from its cached prefix, if any is left).
        chunks = [k for k in kids if k.name == "prefill"]
        assert all(any(chunk.start_time >= moment for chunk in chunks) for moment in moments)
        assert covered(span, kids) >= 0.95


class UsageCallbacks(BaseCallbackHandler):
    def __init__(self) -> None:
        self.usage: list[int] = []

    def on_llm_end(self, response: LLMResult, **kwargs) -> None:
        self.usage.append(response.generations[0][0].message.usage_metadata["output_tokens"])


def test_the_span_crosses_to_the_engine_thread_from_async_engine_and_chat_paged(tokenizer) -> None:
    aengine = AsyncEngine(tiny_llm(tokenizer, num_kv_blocks=64).engine)
    callbacks = UsageCallbacks()
    try:
        with recording() as exporter, tracing.tracer().start_as_current_span("caller") as caller:
            list(aengine.stream([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
            answer = ChatPaged(model=aengine, max_tokens=3).invoke("tell me about rivers",
                                                                  config={"callbacks": [callbacks]})
    finally:
        aengine.shutdown()
    requests = request_spans(exporter.get_finished_spans())
    assert len(requests) == 2
    assert {span.parent.span_id for span in requests} == {caller.get_span_context().span_id}
    # LangChain's callbacks still see the call, with the same usage the span records.
    assert callbacks.usage == [requests[1].attributes["gen_ai.usage.output_tokens"]] == [
        answer.usage_metadata["output_tokens"]]


class BrokenProvider:
    """A tracer provider whose spans cannot be made."""

    def get_tracer(self, *args, **kwargs):
        return self

    def start_span(self, *args, **kwargs):
        raise RuntimeError("exporter misconfigured")


def test_a_failing_tracer_costs_the_request_its_spans_not_its_answer(tokenizer, caplog) -> None:
    llm = tiny_llm(tokenizer, num_kv_blocks=64)
    with tracing.traced_by(BrokenProvider()), caplog.at_level("ERROR"):
        outputs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    assert not llm.engine.has_unfinished_requests()


def test_no_tracer_provider_records_nothing(tokenizer) -> None:
    assert tracing.tracer() is None  # the API's default provider: tracing is off
    outputs = tiny_llm(tokenizer, num_kv_blocks=64).generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert outputs[0].metrics.timeline is None


COLLECTOR_RUN = """
import http.server, json, sys, threading
sys.path.insert(0, sys.argv[1])
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from helpers.server import build_chat_tokenizer, tiny_llama
from paged_backend import LLM, SamplingParams, tracing

bodies = []
class Collector(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        bodies.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
threading.Thread(target=server.serve_forever, daemon=True).start()
assert tracing.tracer() is None
tracing.export_otlp(f"http://127.0.0.1:{server.server_port}/v1/traces")
tokenizer = build_chat_tokenizer(["tell me about rivers and bridges"] * 3)
LLM(tiny_llama(tokenizer), tokenizer, compile=False, num_kv_blocks=64).generate([[5, 6, 7]], SamplingParams(max_tokens=3))
trace.get_tracer_provider().force_flush()
names, services = [], set()
for path, body in bodies:
    assert path == "/v1/traces"
    request = ExportTraceServiceRequest.FromString(body)
    for resource_spans in request.resource_spans:
        services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
        names += [span.name for scope in resource_spans.scope_spans for span in scope.spans]
print(json.dumps({"names": sorted(names), "services": sorted(services)}))
"""


@pytest.mark.slow  # a process exporting to a collector: the slow tier
def test_export_otlp_sends_the_spans_of_a_process_wide_provider_to_a_collector() -> None:
    run = subprocess.run([sys.executable, "-c", COLLECTOR_RUN, str(TESTS)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    sent = json.loads(run.stdout.strip().splitlines()[-1])
    assert sent == {"names": ["decode", "prefill", "queue", "text_completion LlamaForCausalLM"],
                    "services": ["paged-backend"]}
