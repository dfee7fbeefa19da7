"""Spans recorded in memory, through a provider of the test's own (`tracing.traced_by`), so the process's
global tracer provider (which can be set only once) is never touched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from paged_backend import tracing


@contextlib.contextmanager
def recording() -> Iterator[InMemorySpanExporter]:
    """While open, tracing is on and every span the engine and the server make lands in the exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracing.traced_by(provider):
        yield exporter


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                  key=lambda s: s.start_time)


def request_spans(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    """The engine's request spans (one per request), by arrival."""
    return sorted((s for s in spans if "gen_ai.operation.name" in s.attributes and "http.route" not in s.attributes),
                  key=lambda s: s.start_time)


def covered(parent: ReadableSpan, parts: list[ReadableSpan]) -> float:
    """The share of the parent's time that the union of `parts` covers."""
    total, reach = 0, parent.start_time
    for part in sorted(parts, key=lambda s: s.start_time):
        start, end = max(part.start_time, reach), min(part.end_time, parent.end_time)
        if end > start:
            total += end - start
            reach = end
    return total / (parent.end_time - parent.start_time)
