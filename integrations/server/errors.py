"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that emit it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


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
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('msg', '')}"
    elif first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return error_response(APIError(400, message, param))


async def handle_http_exception(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail)))
