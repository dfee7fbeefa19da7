"""The server's life around its app: answering while the model loads, serving, then draining on SIGTERM.

`paged-backend serve` binds its port before it loads the model, so probes and clients get an answer during a
start that may compile for a minute: until the engine has warmed up (graphs compiled or loaded), /health is
a 503 and every other route a 503 saying the model is loading, with `Retry-After`. On SIGTERM (or Ctrl-C)
the server stops admitting requests (a new one, and /health, get a 503, so a balancer takes the server out)
and lets those in flight finish for up to the drain timeout; then it aborts the requests still running,
whose streams end as an aborted request's do (a last chunk with finish_reason "abort", then `[DONE]`), and
exits, the engine shut down and its memory freed. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn

from paged_backend.core.outputs import RequestOutput
from paged_backend.entrypoints.engine_client import EngineClient

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after aborting, how long the last chunks of aborted streams have to go out
LOADING_RETRY_AFTER_S = 5
ALWAYS_SERVED = ("/metrics",)  # answered while draining too: a scrape sees the drain's last requests

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class TrackedClient:
    """The engine client the routes hold, knowing which of its requests are running, so a drain can abort
    the ones left. Everything but starting a request passes straight to `client`."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.running: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, prompt: Any, params: Any = None, request_id: str | None = None,
                       logits_processor: Any = None, lora: Any = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id if request_id is not None else f"serve-{uuid.uuid4().hex}"
        self.running.add(request_id)
        try:
            async for output in self.client.generate(prompt, params, request_id, logits_processor, lora):
                yield output
        finally:
            self.running.discard(request_id)

    async def embed(self, prompt: Any, pooling: Any = None, request_id: str | None = None) -> RequestOutput:
        request_id = request_id if request_id is not None else f"serve-{uuid.uuid4().hex}"
        self.running.add(request_id)
        try:
            return await self.client.embed(prompt, pooling, request_id)
        finally:
            self.running.discard(request_id)

    def abort_running(self) -> int:
        """Abort every running request (each ends with its final output); returns how many."""
        running = list(self.running)
        for request_id in running:
            self.client.abort(request_id)
        return len(running)


class Lifecycle:
    """The ASGI app uvicorn runs: it answers for the server while it loads and while it drains, and hands
    every other request to the server's app, counting those in flight."""

    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None
        self.client: TrackedClient | None = None
        self.draining = False
        self.in_flight = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    def serve(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], client: TrackedClient) -> None:
        """Start serving `app` (whose routes hold `client`): the model has loaded and warmed up. Any thread."""
        self.client = client
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        if scope["type"] != "http":  # the API has no websockets
            return
        if self.app is None:
            await unavailable(send, "the model is still loading", LOADING_RETRY_AFTER_S)
            return
        if self.draining and scope["path"] not in ALWAYS_SERVED:
            await unavailable(send, "the server is shutting down")
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def drain(self) -> None:
        """Refuse new requests, give those in flight the drain timeout, then abort the rest and give their
        streams ABORT_GRACE_S to send their last chunks."""
        self.draining = True
        logger.info("draining: %d request(s) in flight, up to %.0f s to finish", self.in_flight, self.drain_timeout)
        if await self.settled(self.drain_timeout):
            return
        aborted = self.client.abort_running() if self.client is not None else 0
        logger.warning("drain timeout: aborted %d running request(s)", aborted)
        if not await self.settled(ABORT_GRACE_S):
            logger.warning("%d request(s) still open after aborting; closing them", self.in_flight)

    async def settled(self, timeout: float) -> bool:
        """Whether every request in flight ended within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain between the first SIGTERM (or Ctrl-C) and its own shutdown; a second
    signal shuts down at once, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_task: asyncio.Future | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = self.lifecycle.loop
        if self.drain_task is not None or loop is None or loop.is_closed():
            super().handle_exit(sig, frame)
            return
        self.drain_task = asyncio.run_coroutine_threadsafe(self.drain_then_exit(), loop)

    async def drain_then_exit(self) -> None:
        try:
            await self.lifecycle.drain()
        finally:
            self.should_exit = True


async def unavailable(send: Send, message: str, retry_after: int | None = None) -> None:
    """A 503 with an OpenAI-style error body."""
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": 503}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
