"""OpenTelemetry traces of requests: what each request went through in the engine, as spans.

Off unless the application has set an OpenTelemetry tracer provider (`trace.set_tracer_provider`, or
`paged-backend serve --otlp-traces-endpoint`); without opentelemetry installed it is off too. When on,
every request gets a span from its arrival to its finish, named and described by the GenAI semantic
conventions (`text_completion <model>`, `gen_ai.usage.*`, `gen_ai.response.finish_reasons`, ...),
whose children tile its time: `queue` (arrival to first scheduled; again after a preemption), `grammar`
(a structured request's wait for its grammar), one `prefill` per chunk of the prompt (or of a recompute)
and `decode` (first token to finish); events mark each preemption and the first token. Its parent is
the span that was current where the request was submitted (a server route's, which itself continues the
client's W3C `traceparent`), passed to the engine as W3C headers so that it can cross threads.

The engine's thread only appends times to a traced request's `Timeline` (one tuple per prefill chunk,
one float per preemption) and makes the spans once the request has finished, from those times: no span
stays open across steps, and a step with no traced request reads one attribute per request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import propagate, trace
except ImportError:  # the `trace` extra is not installed: tracing stays off
    trace = None

if TYPE_CHECKING:
    from paged_backend.core.outputs import RequestOutput
    from paged_backend.core.scheduler_output import SchedulerOutput
    from paged_backend.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TRACER_NAME = "paged_backend"
PROVIDER = "paged_backend"  # gen_ai.provider.name: the engine that served the request


@dataclass(slots=True)
class Timeline:
    """A traced request's course through the engine, in `time.time()` seconds, recorded on the engine's
    thread; its spans are made from it when the request ends (`end_spans`)."""

    headers: dict[str, str]  # the W3C trace context its span continues (empty: a trace of its own)
    attributes: dict[str, Any]  # its span's attributes known at arrival (model, sampling parameters)
    operation: str = "text_completion"  # gen_ai.operation.name
    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)  # (start, end, position, tokens)
    preemptions: list[float] = field(default_factory=list)
    grammar_ready: float | None = None


_provider: Any | None = None  # set by `traced_by`: the provider spans go to instead of the global one
_warned = False  # whether a failing tracer has been reported (warn_once)


@contextlib.contextmanager
def traced_by(provider: Any) -> Iterator[None]:
    """While open, the engine's spans go to `provider` whatever the process's global provider is (which
    OpenTelemetry lets be set only once): for tests, benchmarks, or keeping the engine's spans apart."""
    global _provider
    before, _provider = _provider, provider
    try:
        yield
    finally:
        _provider = before


def tracer() -> Any | None:
    """The tracer of the application's tracer provider; None when tracing is off (opentelemetry missing,
    or no provider set: the API's default one records nothing)."""
    if _provider is not None:
        return _provider.get_tracer(TRACER_NAME)
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer(TRACER_NAME)


def export_otlp(endpoint: str, service_name: str = "paged-backend") -> None:
    """Send spans to an OTLP/HTTP collector at `endpoint` (e.g. `http://localhost:4318/v1/traces`) from a
    tracer provider set for this process, as `serve --otlp-traces-endpoint` does; ImportError naming the
    extra when its packages are missing."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ImportError("traces need the trace extra: pip install 'paged-backend[trace]'") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)


def current_headers() -> dict[str, str] | None:
    """The caller's current trace context as W3C headers, for a request handed to another thread; None
    when tracing is off."""
    if tracer() is None:
        return None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def start_timeline(headers: Mapping[str, str] | None, model: str, params: SamplingParams | None,
                   operation: str = "text_completion") -> Timeline | None:
    """A timeline for a new request when tracing is on (None otherwise): its span will continue `headers`
    (the current thread's context when None) and carry the request's model and sampling parameters."""
    try:
        if tracer() is None:
            return None
        if headers is None:
            headers = current_headers() or {}
    except Exception:  # noqa: BLE001  (a provider or propagator of the application's that fails: no trace)
        warn_once("reading the trace context failed; the request runs untraced")
        return None
    attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model}
    if params is not None:
        attributes |= sampling_attributes(params)
    return Timeline(dict(headers), attributes, operation)


def warn_once(message: str) -> None:
    """Log `message` with the exception being handled, the first time only (a broken tracer fails every call)."""
    global _warned
    if not _warned:
        _warned = True
        logger.exception(message)


def sampling_attributes(params: SamplingParams) -> dict[str, Any]:
    attributes = {"gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
                  "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": max(params.top_k, 0) or None,
                  "gen_ai.request.frequency_penalty": params.frequency_penalty,
                  "gen_ai.request.presence_penalty": params.presence_penalty, "gen_ai.request.seed": params.seed,
                  "gen_ai.request.choice.count": params.n}
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    return {key: value for key, value in attributes.items() if value is not None}


def record_chunks(batch: SchedulerOutput, start: float, end: float) -> None:
    """Note the prompt chunks (first prefill or a recompute after preemption) the step ran for traced
    requests; called before the step's progress is counted, so `num_computed_tokens` is the chunk's start."""
    for request, tokens in zip(batch.requests, batch.num_new_tokens):
        timeline = request.metrics.timeline
        if timeline is not None and (not request.output_token_ids
                                     or request.num_computed_tokens < request.num_tokens - 1):
            timeline.chunks.append((start, end, request.num_computed_tokens, tokens))


def end_spans(outputs: list[RequestOutput]) -> None:
    """Make the spans of every traced request that has finished among `outputs`. A tracer that fails costs
    the request its spans, never the engine its step (said once)."""
    for output in outputs:
        if output.finished and output.metrics.timeline is not None:
            try:
                make_spans(output)
            except Exception:  # noqa: BLE001  (the application's tracer provider: not the engine's to fail on)
                warn_once("making a request's spans failed; the request is unaffected")


def make_spans(output: RequestOutput) -> None:
    """The request's span and its children, from its timeline and metrics (times set when they happened)."""
    m, timeline = output.metrics, output.metrics.timeline
    otel = tracer()
    if otel is None:  # the provider went away meanwhile
        return
    finished = m.finished_time or time.time()
    model = timeline.attributes["gen_ai.request.model"]
    span = otel.start_span(f"{timeline.operation} {model}", context=propagate.extract(timeline.headers),
                           kind=trace.SpanKind.INTERNAL, start_time=ns(m.arrival_time),
                           attributes=timeline.attributes | result_attributes(output))
    within = trace.set_span_in_context(span)
    for start, end in queue_intervals(output, finished):
        otel.start_span("queue", context=within, start_time=ns(start)).end(ns(end))
    if timeline.grammar_ready is not None:
        otel.start_span("grammar", context=within, start_time=ns(m.arrival_time)).end(ns(timeline.grammar_ready))
    for index, (start, end, position, tokens) in enumerate(timeline.chunks):
        attributes = {"paged_backend.chunk.position": position, "paged_backend.chunk.tokens": tokens}
        if index == 0:
            attributes["paged_backend.prefix_cache.hit_tokens"] = output.num_cached_tokens
        otel.start_span("prefill", context=within, start_time=ns(start), attributes=attributes).end(ns(end))
    if m.first_token_time is not None:
        span.add_event("first_token", timestamp=ns(m.first_token_time))
        otel.start_span("decode", context=within, start_time=ns(m.first_token_time),
                        attributes={"gen_ai.usage.output_tokens": output_tokens(output)}).end(ns(finished))
    for moment in timeline.preemptions:
        span.add_event("preempted", timestamp=ns(moment))
    if output.error:
        span.set_status(trace.Status(trace.StatusCode.ERROR, output.error))
    span.end(ns(finished))


def queue_intervals(output: RequestOutput, finished: float) -> list[tuple[float, float]]:
    """When the request waited to be scheduled: from arrival (or its grammar being ready) to its first
    chunk, and from each preemption to the next chunk after it."""
    m, timeline = output.metrics, output.metrics.timeline
    starts = [timeline.grammar_ready or m.arrival_time, *timeline.preemptions]
    chunk_starts = [chunk[0] for chunk in timeline.chunks]
    intervals = []
    for start in starts:
        later = [t for t in chunk_starts if t >= start]
        end = min(later) if later else finished  # no chunk after it: it ended while waiting (aborted, failed)
        intervals.append((start, end))
    return intervals


def result_attributes(output: RequestOutput) -> dict[str, Any]:
    m = output.metrics
    attributes = {"gen_ai.response.id": output.request_id,
                  "gen_ai.response.model": output.metrics.timeline.attributes["gen_ai.request.model"],
                  "gen_ai.usage.input_tokens": len(output.prompt_token_ids),
                  "gen_ai.usage.output_tokens": output_tokens(output),
                  "gen_ai.usage.cache_read.input_tokens": output.num_cached_tokens,
                  "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in output.outputs],
                  "paged_backend.request.preemptions": m.num_preemptions}
    if m.first_scheduled_time is not None:
        attributes["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
    if m.first_token_time is not None:
        attributes["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
    if m.finished_time is not None:
        attributes["gen_ai.latency.e2e"] = m.finished_time - m.arrival_time
    return attributes


def output_tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs)


def ns(seconds: float) -> int:
    """`time.time()` seconds as OpenTelemetry's nanoseconds since the epoch."""
    return int(seconds * 1e9)
