"""POST /v1/embeddings: each input's final hidden states pooled by the engine (core/pooling.py), in
OpenAI's shape, as floats or as base64 of little-endian float32 (what the openai SDK asks for by default).

`dimensions` is refused (400) unless the model was trained for truncated embeddings (Matryoshka) or
it names the model's own size. Two fields beyond OpenAI's choose the pooling: `pooling` ("last", the
default, or "mean") and `normalize` (true by default).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from paged_backend.core.pooling import PoolingParams
from paged_backend.errors import ContextLengthError

from .errors import APIError, bad_request, request_field
from .fanout import new_id, until_disconnect
from .protocol import STRICT, TokenId
from .state import ServerState


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # the caller's own bookkeeping: it changes no output
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings", dependencies=state.authorised())
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        return await create_embeddings(state, body, request)


async def create_embeddings(state: ServerState, body: EmbeddingRequest, http_request: Request) -> JSONResponse:
    if state.check_model(body.model) is not None:
        raise bad_request("embeddings run on the base model, not on LoRA adapters", "model")
    inputs = input_list(body.input)
    state.check_sequences(len(inputs), 1, "input")
    pooling = PoolingParams(pooling=body.pooling, normalize=body.normalize, dimensions=body.dimensions)
    with request_field("input"):
        token_lists = [state.tokenize(item, "input")[1] for item in inputs]
    for i, ids in enumerate(token_lists):
        check_input(state, ids, pooling, i if len(inputs) > 1 else None)
    request_id = new_id("embd")
    jobs = [state.client.embed(ids, pooling, f"{request_id}-{i}") for i, ids in enumerate(token_lists)]
    finals = await until_disconnect(http_request, asyncio.gather(*jobs))
    failed = [out.error for out in finals if out.error or out.embedding is None]
    if failed:
        raise APIError(500, f"embedding failed: {failed[0]}")
    data = [{"object": "embedding", "index": i, "embedding": encode(out.embedding.numpy(), body.encoding_format)}
            for i, out in enumerate(finals)]
    tokens = sum(len(ids) for ids in token_lists)
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def input_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be empty", "input")
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)


def check_input(state: ServerState, ids: list[int], pooling: PoolingParams, index: int | None) -> None:
    """A 400 for an input the engine would refuse: naming `dimensions` when that is the fault, else `input`."""
    where = "" if index is None else f"input[{index}]: "
    try:
        state.client.validate_pooling(ids, pooling)
    except ContextLengthError as exc:
        raise APIError(400, where + str(exc), "input", "context_length_exceeded") from None
    except ValueError as exc:
        message = str(exc)
        if message.startswith("dimensions"):
            raise bad_request(message, "dimensions") from None
        raise APIError(400, where + message, "input") from None


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def decode(text: str) -> list[float]:
    """The inverse of base64 encoding (for clients and tests)."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()
