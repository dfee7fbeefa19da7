"""RouteSpans: an OpenTelemetry server span for each HTTP request while tracing is on (paged_backend/tracing.py).

The span continues the client's W3C `traceparent` (and `tracestate`), is named after the route's template
(`POST /v1/chat/completions`), lasts until the answer's last byte (a stream's included) and is current while
the route runs, so the engine spans of the requests it submits are its children. With tracing off, a
request costs one check.
"""

from __future__ import annotations

from paged_backend import tracing


class RouteSpans:
    """A plain ASGI middleware, so streams pass through unbuffered."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        otel = tracing.tracer() if scope["type"] == "http" else None
        if otel is None:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, propagate, trace

        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", [])}
        span = otel.start_span(f"{scope['method']} {scope['path']}", context=propagate.extract(headers),
                               kind=trace.SpanKind.SERVER,
                               attributes={"http.request.method": scope["method"], "url.path": scope["path"]})
        status = 500

        async def capture(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, capture)
        finally:
            context.detach(token)
            end_route_span(span, getattr(scope.get("route"), "path", None), scope["method"], status)


def end_route_span(span, route: str | None, method: str, status: int) -> None:
    """Name the span after the route's template (never an id in the path) and record the answer's status."""
    from opentelemetry import trace

    if route is not None:
        span.update_name(f"{method} {route}")
        span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()
