"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that emit it."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


# What each error status means on an API route, for the OpenAPI document (FastAPI lists only 200 and 422
# by itself, so schema fuzzers and client generators would not know these answers).
ERROR_MEANINGS = {
    400: "The request is malformed or asks for what this server cannot do; `param` names the field.",
    401: "The API key is missing or wrong.",
    404: "No such model, LoRA adapter or stored response.",
    405: "The path does not take this method; the `Allow` header names those it takes.",
    499: "The client closed the connection before the answer was complete.",
    500: "An unexpected error in the server.",
}
ALLOW_HEADER = {"Allow": {"description": "The methods the path takes.", "schema": {"type": "string"}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape (`error_body`), as the OpenAPI document declares it."""

    error: ErrorDetail


def error_responses(keyed: bool, model: Any = ErrorBody, codes: tuple[int, ...] = tuple(ERROR_MEANINGS)
                    ) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of the `codes` an API route answers in `model`'s shape; 401 only when an
    API key is set (`keyed`), as only then is it answered."""
    responses: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        if code != 401 or keyed:
            responses[code] = {"model": model, "description": ERROR_MEANINGS[code]}
    if 405 in responses:
        responses[405]["headers"] = ALLOW_HEADER
    return responses


class APIError(Exception):
    """An error to return to the client with this HTTP status, in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def not_supported(param: str, why: str = "") -> APIError:
    """An OpenAI parameter this server cannot honour: refused rather than silently ignored."""
    return APIError(400, f"'{param}' is not supported by this server{': ' + why if why else ''}", param,
                    "unsupported_parameter")


@contextmanager
def request_field(param: str) -> Iterator[None]:
    """Read one field of the request: any error raised while validating or translating it (a schema of
    an unexpected shape, a message whose parts are the wrong type) is the client's, so a 400 naming the
    field. APIErrors pass through unchanged."""
    try:
        yield
    except APIError:
        raise
    except Exception as exc:  # whatever the translation raised, the input caused it
        logger.debug("request field %s refused", param, exc_info=exc)
        raise bad_request(f"{param} could not be read: {type(exc).__name__}: {exc}", param) from None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)


async def handle_api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def handle_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Malformed JSON, a missing field, an unknown field or a value of the wrong type: all 400, as OpenAI."""
    first = exc.errors()[0] if exc.errors() else {}
    param = param_of(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('msg', '')}"
    elif first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return error_response(APIError(400, message, param))


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def param_of(location: tuple[Any, ...]) -> str | None:
    """The field path of a validation error's location, without pydantic's union tags: a union's
    failing member is named like `list[str]` or a class name, which is no field of the request."""
    parts: list[str] = []
    for part in location:
        is_tag = isinstance(part, str) and (part in TYPE_TAGS or not re.fullmatch(r"[a-z_][a-z0-9_]*", part))
        if part == "body" and not parts:
            continue
        if is_tag:
            if parts:  # past the field: the rest describes one member of its union
                break
            continue  # a body that is a union of models names the member first
        parts.append(str(part))
    return ".".join(parts) or None


async def handle_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    response = error_response(APIError(exc.status_code, str(exc.detail)))
    if exc.status_code == 405:  # RFC 9110 asks a 405 to say which methods the path takes
        response.headers["Allow"] = allowed_methods(request)
    return response


def allowed_methods(request: Request) -> str:
    """The methods some route takes at the request's path: a path may have a route per method
    (GET and DELETE /v1/responses/{id}), and Starlette names only the first route's."""
    methods = set()
    for route in request.app.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


class JSONErrors:
    """ASGI middleware: an unexpected error inside a handler becomes a JSON 500 (OpenAI's shape), and
    nothing is re-raised to the HTTP server, so it keeps the keep-alive connection open for the next
    request. A stream that fails after its first bytes is ended cleanly (its last event already says
    what went wrong when the handler could tell)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def track(message) -> None:
            nonlocal started, finished
            started = started or message["type"] == "http.response.start"
            finished = finished or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, track)
        except Exception as exc:  # the last line of defence: never a bare 500 or a reset connection
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if not started:
                response = JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)
                await response(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
