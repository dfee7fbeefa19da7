"""create_app: the FastAPI application serving one engine client (an AsyncEngine, or replicas behind
Ray) with OpenAI's API, /generate, vLLM's tokenizer routes and metrics."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from paged_backend.entrypoints.engine_client import EngineClient
from paged_backend.entrypoints.reasoning import resolve_reasoning_parser

from paged_backend.entrypoints.tool_calls import AUTO, resolve_tool_parser
from . import chat, completions, embeddings, legacy, messages, responses_api, tokenization
from .errors import APIError, JSONErrors, error_responses, install_error_handlers
from .metrics import CURRENT_SCOPE, ServerMetrics
from .protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from .response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from .route_spans import RouteSpans
from .state import DEFAULT_MAX_SEQS_PER_REQUEST, ServerState

CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before the answer's end


def create_app(aengine: EngineClient, model_name: str, api_key: str | None = None,
               max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
               allow_runtime_lora_updating: bool = False,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, reasoning_parser: str | None = AUTO,
               tool_call_parser: str | None = AUTO) -> FastAPI:
    """The app for `aengine` (any `EngineClient`); `model_name` is what clients must send as `model` (or the name of one of the
    engine's LoRA adapters); with `api_key` set, every /v1, /generate and tokenizer request needs
    `Authorization: Bearer <api_key>`; a request that would start more than `max_seqs_per_request`
    sequences (prompts x choices) is a 400. With `allow_runtime_lora_updating`, clients may load and
    unload adapters (vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`). `/v1/responses` keeps the
    last `max_stored_responses` responses for `previous_response_id` (response_store.py). `reasoning_parser`
    and `tool_call_parser` name the model's reasoning and tool-call formats ("auto": read from its chat
    template; an unknown name is a ValueError naming the option)."""
    tokenizer = getattr(aengine, "tokenizer", None)  # None: no chat template to read the formats from
    state = ServerState(aengine, model_name, ServerMetrics(aengine, model_name), api_key, max_seqs_per_request,
                        resolve_reasoning_parser(reasoning_parser, tokenizer),
                        resolve_tool_parser(tool_call_parser, tokenizer))
    app = FastAPI(title="paged-backend", docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(JSONErrors)  # inside the counter, so the 500s it writes are counted
    app.add_middleware(HTTPStatusCounter, metrics=state.metrics)
    app.add_middleware(RouteSpans)  # outermost: the route's span covers everything the server does
    add_plain_routes(app, state)
    # Every route added from here on is an API route: each declares the errors it answers in the OpenAPI
    # document (FastAPI merges the router's responses into each route as it is added; a route's own win).
    app.router.responses = error_responses(api_key is not None)
    app.state.responses = ResponseStore(max_stored_responses)  # what /v1/responses keeps
    for add_routes in API_ROUTES:
        add_routes(app, state)
    if allow_runtime_lora_updating:
        add_lora_routes(app, state)
    return app


def add_plain_routes(app: FastAPI, state: ServerState) -> None:
    """Routes for operators and probes, outside the API: no key, nothing to refuse, no errors declared."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.client.is_alive() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Off the event loop: the engine's stats are answered between two of its steps.
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4")


def add_model_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models", dependencies=state.authorised())
    async def models() -> JSONResponse:
        base = model_card(state)
        adapters = [base | {"id": name, "parent": state.model_name} for name in state.lora_names()]
        return JSONResponse({"object": "list", "data": [base, *adapters]})


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's runtime adapter routes (only when the deployer allows them: they read server-side paths)."""
    @app.post("/v1/load_lora_adapter", dependencies=state.authorised())
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        if not state.client.supports_lora:
            raise APIError(400, "this server's engine was started without LoRA (--enable-lora)", "lora_name")
        if body.lora_name == state.model_name:
            raise APIError(400, f"`{body.lora_name}` is the base model's name", "lora_name")
        try:  # reading the weights takes a while: off the event loop
            await asyncio.to_thread(state.client.add_lora, body.lora_name, body.lora_path)
        except (ValueError, TypeError, OSError) as exc:
            raise APIError(400, str(exc), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=state.authorised())
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        try:  # a replicated engine waits for its replicas: off the event loop
            await asyncio.to_thread(state.client.remove_lora, body.lora_name)
        except ValueError as exc:
            raise APIError(404, str(exc), "lora_name", "model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


# Every group of API routes is added one way, `add_routes(app, state)`, each route declaring `state.authorised()`
# (Anthropic's messages routes check the key as x-api-key, as its clients send it).
API_ROUTES = (add_model_routes, completions.add_routes, chat.add_routes, legacy.add_routes, tokenization.add_routes,
              responses_api.add_routes, embeddings.add_routes, messages.add_routes)


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "paged-backend",
            "max_model_len": state.client.max_model_len}


class HTTPStatusCounter:
    """Counts responses by route and status code (a plain ASGI middleware, so streams are not buffered). A
    response the client hung up on before its end counts as 499, "client closed request", as a plain request
    the client leaves does (`fanout.until_disconnect`): a stream has sent its 200 before it knows."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, finished, gone, started = 500, False, False, time.perf_counter()

        async def listen():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def capture(message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            finished = finished or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        token = CURRENT_SCOPE.set(scope)
        try:
            await self.app(scope, listen, capture)
        finally:
            CURRENT_SCOPE.reset(token)
            route = getattr(scope.get("route"), "path", None)
            self.metrics.record_http(route, CLIENT_CLOSED if gone and not finished else status,
                                     time.perf_counter() - started)
