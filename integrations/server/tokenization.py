"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize and GET /tokenizer_info.

Evaluation harnesses (lm-eval's `local-completions`) probe /tokenizer_info and /tokenize to count and
split prompts with the server's own tokenizer instead of loading one themselves.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from .chat_template import render_chat
from .errors import bad_request, request_field
from .protocol import STRICT, Tool
from .state import ServerState


class TokenizeCompletionRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def tokenize(state: ServerState, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"}: a prompt's ids, or a chat's through its template."""
    check_model(state, body.model)
    tokenizer = needs_tokenizer(state)
    if isinstance(body, TokenizeChatRequest):
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        with request_field("messages"):
            ids = render_chat(tokenizer, body.messages, tools, body.add_generation_prompt, body.chat_template_kwargs)
    else:
        with request_field("prompt"):
            ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.client.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, str]:
    check_model(state, body.model)
    tokenizer = needs_tokenizer(state)
    outside = [t for t in body.tokens if not 0 <= t < state.client.vocab_size]
    if outside:
        raise bad_request(f"token ids {outside[:5]} are outside the vocabulary [0, {state.client.vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """The tokenizer's class, special tokens and chat template: what a client needs to tokenize as we do."""
    tokenizer = needs_tokenizer(state)
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": state.client.max_model_len,
                            "vocab_size": state.client.vocab_size,
                            "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = str(token) if token is not None else None
        info[f"{name}_id"] = getattr(tokenizer, f"{name}_id", None)
    return info


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None:  # optional here, as in vLLM
        state.check_model(model)


def needs_tokenizer(state: ServerState) -> Any:
    if state.tokenizer is None:
        raise bad_request("this model was loaded without a tokenizer", None)
    return state.tokenizer


def add_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's tokenizer routes."""
    @app.post("/tokenize", dependencies=state.authorised())
    async def tokenize_route(body: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        return JSONResponse(tokenize(state, body))

    @app.post("/detokenize", dependencies=state.authorised())
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(detokenize(state, body))

    @app.get("/tokenizer_info", dependencies=state.authorised())
    async def tokenizer_info_route() -> JSONResponse:
        return JSONResponse(tokenizer_info(state))
