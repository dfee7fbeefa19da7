"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, for agent clients that
speak it.

A request becomes a chat conversation (`system` as the system turn, `tool_use` blocks as the assistant's
tool calls, `tool_result` blocks as tool messages) built into the same chat turn as /v1/chat/completions
builds (`paged_backend/entrypoints/chat_turn.py`), with its tool policy and forced-call grammar in the
server's tool-call format (`tool_choice` any / tool). The answer is read by the turn's reader (the
server's reasoning parser and tool-call format) into `thinking`, text and `tool_use` blocks, returned whole or streamed as Anthropic's events (`message_start` ... `message_stop`,
`thinking_delta` for the thinking). `thinking` maps onto the model's own switch: enabled (its
`budget_tokens` a thinking budget) or adaptive turn it on, disabled off (`thinking.thinking_switch`). Errors use
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), the message naming the field;
the key may come as `x-api-key` or as a bearer token.
"""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paged_backend.core.outputs import RequestOutput
from paged_backend.integrations.options.vocabularies import OPENAI

from paged_backend.entrypoints.answer_reader import AnswerReader, AnswerStream, Pieces, cut_off
from paged_backend.entrypoints.structured import chosen_tool_name
from paged_backend.entrypoints.tool_calls.answer_calls import ToolCall
from paged_backend.entrypoints.tool_calls.base import CallDelta
from .chat_template import render_chat
from .chat_turn import TurnFields, check_tools, route_turn
from .errors import APIError, ErrorBody, bad_request, error_responses, not_supported, param_of, request_field
from .fanout import Job, collect_finals, merge_streams
from .protocol import Tool
from .sampling import build_params
from .state import ServerState
from .thinking import Thinking, thinking_switch

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 499: "invalid_request_error", 500: "api_error", 503: "overloaded_error"}
STRICT = ConfigDict(extra="forbid", strict=True)


class MessagesRequest(BaseModel):
    model_config = STRICT
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # the caller's bookkeeping (user_id): it changes no output
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None

    def check_supported(self) -> None:
        if self.service_tier not in (None, "auto", "standard_only"):
            raise not_supported("service_tier", "one service tier")


class CountTokensRequest(BaseModel):
    model_config = STRICT
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def add_routes(app: FastAPI, state: ServerState) -> None:
    errors = anthropic_responses(state.api_key is not None)

    @app.post("/v1/messages", openapi_extra=json_body(MessagesRequest), responses=errors)
    async def messages(request: Request):
        return await anthropic_errors(create_message, state, request, MessagesRequest)

    @app.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest), responses=errors)
    async def count_tokens(request: Request):
        return await anthropic_errors(count_message_tokens, state, request, CountTokensRequest)


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error shape (`anthropic_error`), as the OpenAPI document declares it."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def anthropic_responses(keyed: bool) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI error responses of the routes here: what the route refuses is in Anthropic's shape, but
    a 405 is answered before the route, and an unexpected error outside it in OpenAI's (the API's
    default), so a 500 may be either."""
    responses = error_responses(keyed, AnthropicErrorBody, (400, 401, 404, 499))
    return responses | error_responses(keyed, AnthropicErrorBody | ErrorBody, (500,))


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads `model` itself (to refuse in Anthropic's error shape,
    not FastAPI's): declared, so the schema's readers (clients' generators, fuzzers) see the route's body."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def anthropic_errors(handler, state: ServerState, request: Request, model: type[BaseModel]):
    """Run `handler` with the validated body; any refusal in Anthropic's error shape."""
    try:
        check_key(state, request)
        body = await read_body(request, model)
        return await handler(state, body, request)
    except APIError as exc:
        return anthropic_error(exc.status, exc.message)


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = request.headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
    if not hmac.compare_digest(given, state.api_key):
        raise APIError(401, "invalid x-api-key")


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    try:
        data = await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = param_of(first.get("loc", ()))
        message = f"{field}: Extra inputs are not permitted" if first.get("type") == "extra_forbidden" \
            else f"{field or 'body'}: {first.get('msg', 'invalid value')}"
        raise bad_request(message, field) from None


# ------------------------------------------------------------------ the request as a conversation


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]],
                  images: bool = False) -> list[dict[str, Any]]:
    """The request's conversation as chat messages; `images`: the engine takes image blocks (else refused)."""
    converted = [{"role": "system", "content": block_text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"messages.{i}.role: must be 'user' or 'assistant', got {role!r}", f"messages.{i}.role")
        content = message.get("content")
        if isinstance(content, str):
            converted.append({"role": role, "content": content})
        elif isinstance(content, list):
            converted.extend(user_turn(content, i, images) if role == "user" else [assistant_turn(content, i)])
        else:
            raise bad_request(f"messages.{i}.content: must be a string or a list of content blocks",
                              f"messages.{i}.content")
    return converted


def user_turn(blocks: list[Any], index: int, images: bool = False) -> list[dict[str, Any]]:
    """Tool results become tool messages (in order), the text (and images, where the engine takes them) one user
    turn after them."""
    turns, texts = [], []
    for j, block in enumerate(blocks):
        kind = kind_of(block, f"messages.{index}.content.{j}")
        if kind == "text":
            texts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image" and images:
            texts.append(block)
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"messages.{index}.content.{j}.tool_use_id: Field required",
                                  f"messages.{index}.content.{j}.tool_use_id")
            turns.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": block_text(block.get("content", ""), f"messages.{index}.content.{j}.content")})
        else:
            raise not_supported(f"messages.{index}.content.{j}", f"content block of type {kind!r} in a user turn "
                                "(this text-only model takes text and tool_result)")
    if any(part["type"] == "image" for part in texts):
        turns.append({"role": "user", "content": texts})
    elif texts:
        turns.append({"role": "user", "content": "".join(part["text"] for part in texts)})
    return turns


def assistant_turn(blocks: list[Any], index: int) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        where = f"messages.{index}.content.{j}"
        kind = kind_of(block, where)
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{where}: a tool_use block needs a string name and an object input", where)
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thinking: chat templates leave it out of later prompts
        else:
            raise not_supported(where, f"content block of type {kind!r} in an assistant turn")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def kind_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where}: a content block must be an object with a type", where)
    return block["type"]


def block_text(content: Any, where: str) -> str:
    """A string, or text blocks (anything else is refused, naming the block)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks", where)
    for j, block in enumerate(content):
        if kind_of(block, f"{where}.{j}") != "text":
            raise not_supported(f"{where}.{j}", f"content block of type {block['type']!r}: text only here")
    return "".join(str(block.get("text", "")) for block in content)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools in the chat shape; Anthropic's server tools (web search, bash, ...) are refused."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise not_supported(f"tools.{i}.type", f"server tool {tool['type']!r}: only client tools run here")
        spec = {"name": tool.get("name"), "description": tool.get("description"), "parameters": tool.get("input_schema")}
        unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if unknown:
            raise bad_request(f"tools.{i}.{min(unknown)}: Extra inputs are not permitted", f"tools.{i}.{min(unknown)}")
        with request_field(f"tools.{i}"):
            converted.append(Tool.model_validate({"type": "function", "function": spec}).model_dump(exclude_none=True))
    return converted


def chat_tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> tuple[Any, bool]:
    """(the chat route's tool_choice, whether parallel calls are allowed)."""
    choice = choice or {"type": "auto"}
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        if not tools:
            raise bad_request("tool_choice: 'any' needs tools", "tool_choice")
        return "required", parallel
    if kind == "tool":
        named = {"type": "function", "function": {"name": choice.get("name")}}
        try:
            chosen_tool_name(tools or [], named)
        except ValueError as exc:
            raise bad_request(f"tool_choice: {exc}", "tool_choice") from None
        return named, parallel
    raise bad_request(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def thinking_of(state: ServerState, thinking: dict[str, Any] | None) -> Thinking:
    """`thinking` on the served model: enabled (with `budget_tokens` as its thinking budget) or adaptive
    turn a reasoning model's thinking on, disabled turns it off."""
    if thinking is None:
        return Thinking()
    unknown = set(thinking) - {"type", "budget_tokens", "display"}
    if unknown:
        raise bad_request(f"thinking.{min(unknown)}: Extra inputs are not permitted", f"thinking.{min(unknown)}")
    if thinking.get("display") not in (None, "summarized"):
        raise not_supported("thinking.display", "the thinking is shown whole or not asked for")
    kind = thinking.get("type")
    if kind == "disabled":
        return thinking_switch(state, False, "thinking")
    if kind == "adaptive":
        return thinking_switch(state, True, "thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise bad_request(f"thinking.budget_tokens: must be an integer >= 0, got {budget!r}",
                              "thinking.budget_tokens")
        return thinking_switch(state, True, "thinking", budget)
    raise bad_request(f"thinking.type: must be enabled, disabled or adaptive, got {kind!r}", "thinking.type")


def prompt_of(state: ServerState, body: CountTokensRequest, thinking: Thinking) -> list[int]:
    """The prompt ids a request's conversation renders to, its tools shown as the turn shows them."""
    tools = chat_tools(body.tools)
    choice, _ = chat_tool_choice(body.tool_choice, tools)
    messages = chat_messages(body.system, body.messages)
    in_play = tools if tools and choice != "none" else None
    with request_field("messages"):
        return render_chat(state.tokenizer, messages, in_play, template_kwargs=thinking.template_kwargs)


# ------------------------------------------------------------------ routes


MESSAGES_FIELDS = TurnFields(thinking_budget="thinking", read=frozenset({"tools"}))


async def count_message_tokens(state: ServerState, body: CountTokensRequest, _: Request) -> JSONResponse:
    state.check_model(body.model)
    ids = prompt_of(state, body, thinking_of(state, body.thinking))
    return JSONResponse({"input_tokens": len(ids)})


async def create_message(state: ServerState, body: MessagesRequest, http_request: Request):
    body.check_supported()
    lora = state.check_model(body.model)
    thinking = thinking_of(state, body.thinking)
    tools = chat_tools(body.tools)
    choice, parallel = chat_tool_choice(body.tool_choice, tools)
    messages = chat_messages(body.system, body.messages, images=state.client.image_prompts is not None)
    check_tools(tools if choice != "none" else None, "tools.{}.input_schema")
    params = build_params(OPENAI, sampling_options(body), max_tokens=body.max_tokens)
    turn = route_turn(state, messages, params, MESSAGES_FIELDS, tools=tools,
                      tool_choice=choice, parallel_tool_calls=parallel, thinking_budget=thinking.budget,
                      template_kwargs=thinking.template_kwargs)
    reader = turn.reader
    message_id = f"msg_{uuid.uuid4().hex}"
    jobs = [Job(0, turn.prompt_ids, turn.params, turn.processor, lora, turn.images)]
    if body.stream:
        return StreamingResponse(stream_message(state, body, jobs, message_id, reader),
                                 media_type="text/event-stream")
    final = (await collect_finals(http_request, state.client, jobs, message_id, state.metrics))[0]
    reasoning, content, calls = reader.split(reader.answer_of(final.outputs[0]), cut_off(final.outputs[0]))
    return JSONResponse(envelope(message_id, body.model, content_blocks(reasoning, content, calls), final)
                        | stop_fields(final, calls))


def sampling_options(body: MessagesRequest) -> dict[str, Any]:
    options: dict[str, Any] = {"temperature": body.temperature, "stop": body.stop_sequences or []}
    if body.top_p is not None:
        options["top_p"] = body.top_p
    if body.top_k is not None:
        options["top_k"] = body.top_k
    return options


def envelope(message_id: str, model: str, content: list[dict[str, Any]], final: RequestOutput | None,
             prompt_tokens: int = 0) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": None, "stop_sequence": None, "usage": usage_of(final, prompt_tokens)}


def usage_of(final: RequestOutput | None, prompt_tokens: int = 0) -> dict[str, int]:
    if final is None:
        return {"input_tokens": prompt_tokens, "output_tokens": 0}
    return {"input_tokens": len(final.prompt_token_ids), "output_tokens": len(final.outputs[0].token_ids),
            "cache_read_input_tokens": final.num_cached_tokens}


def content_blocks(reasoning: str | None, content: str | None, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A thinking block when the model thought (in words), the text, then a tool_use block per call."""
    blocks = [thinking_block(reasoning)] if reasoning else []
    blocks += [{"type": "text", "text": content}] if content else []
    blocks += [tool_use(call.name, call_input(call)) for call in calls]
    return blocks or [{"type": "text", "text": ""}]


def call_input(call: ToolCall) -> dict[str, Any]:
    """A call's `input`: for one cut off by max_tokens, what the anthropic SDK reads from the input it
    streamed (`written_object`), so the plain and the streamed message agree."""
    return json.loads(call.arguments) if call.complete else written_object(call.arguments)


def written_object(text: str) -> dict[str, Any]:
    """The object that JSON text cut short holds: the values written whole, nested ones too ({} when
    none), as a partial-JSON reader gives it."""
    for cut, closers in reversed(cut_points(text)):
        try:
            value = json.loads(text[:cut] + closers)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def cut_points(text: str) -> list[tuple[int, str]]:
    """Where JSON text cut short may end as valid JSON once its open brackets close (after an opening or
    closing bracket, before a comma, at its end), each with those closing brackets. For text a grammar
    held to JSON the end serves, or when a value is half written there, the point before it."""
    points: list[tuple[int, str]] = []
    closers: list[str] = []
    in_string = escaped = False
    for i, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
            points.append((i + 1, "".join(reversed(closers))))
        elif char in "}]" and closers:
            closers.pop()
            points.append((i + 1, "".join(reversed(closers))))
        elif char == ",":
            points.append((i, "".join(reversed(closers))))
    points.append((len(text), "".join(reversed(closers))))
    return points


def thinking_block(text: str) -> dict[str, Any]:
    # No signature: nothing here verifies a thinking block sent back, and templates leave it out anyway.
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use(name: str, arguments: dict[str, Any], block_id: str | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id or f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": arguments}


def stop_fields(final: RequestOutput, calls: list[ToolCall]) -> dict[str, Any]:
    completion = final.outputs[0]
    if cut_off(completion):  # ahead of tool_use: the last call may be unfinished, not one to run
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(completion.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": completion.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


# ------------------------------------------------------------------ streaming


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class BlockWriter:
    """Numbers content blocks and keeps at most one open, closing it before the next starts."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "thinking", "text", or the key of the tool_use block being streamed

    def start(self, key: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.open = key
        events.append(event("content_block_start", index=self.count, content_block=block))
        return events

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.count, delta=delta)

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [event("content_block_stop", index=self.count - 1)]


async def stream_message(state: ServerState, body: MessagesRequest, jobs: list[Job], message_id: str,
                         reader: AnswerReader) -> AsyncIterator[str]:
    blocks = BlockWriter()
    stream: AnswerStream = reader.stream()
    yield event("message_start", message=envelope(message_id, body.model, [], None, len(jobs[0].prompt_ids)))
    yield event("ping")
    final: RequestOutput | None = None
    async for _, output in merge_streams(state.client, jobs, message_id, state.metrics):
        if output.error:
            yield event("error", error={"type": "api_error", "message": f"generation failed: {output.error}"})
            return
        if output.finished:
            final = output
        for text in piece_events(blocks, stream.push(reader.delta_of(output))):
            yield text
    rest = stream.finish(cut_off(final.outputs[0]))
    for text in piece_events(blocks, rest):
        yield text
    for k, call in enumerate(rest.unsent_calls):
        for text in blocks.start(f"call-{rest.streamed + k}", tool_use(call.name, {})):
            yield text
        yield blocks.delta({"type": "input_json_delta", "partial_json": call.arguments})
    if blocks.count == 0 and blocks.open is None:  # an empty answer: one empty text block, as `content_blocks` gives
        for text in blocks.start("text", BLOCKS["text"][0]):
            yield text
    for text in blocks.stop():
        yield text
    usage = usage_of(final)
    yield event("message_delta", delta=stop_fields(final, rest.tool_calls),
                usage={"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"]})
    yield event("message_stop")


def piece_events(blocks: BlockWriter, piece: Pieces) -> list[str]:
    return (block_events(blocks, "thinking", piece.reasoning) + block_events(blocks, "text", piece.content)
            + call_events(blocks, piece.calls))


BLOCKS = {"thinking": (thinking_block(""), "thinking_delta"), "text": ({"type": "text", "text": ""}, "text_delta")}


def block_events(blocks: BlockWriter, kind: str, text: str) -> list[str]:
    """`text` streamed into a thinking or text block, starting one unless that kind is open."""
    if not text:
        return []
    start, delta = BLOCKS[kind]
    events = blocks.start(kind, start) if blocks.open != kind else []
    return events + [blocks.delta({"type": delta, kind: text})]


def call_events(blocks: BlockWriter, deltas: list[CallDelta]) -> list[str]:
    """A forced call's pieces: its block starts with its name, then its input streams as JSON text."""
    events = []
    for delta in deltas:
        key = f"call-{delta.index}"
        if delta.name is not None and blocks.open != key:
            events += blocks.start(key, tool_use(delta.name, {}))
        if delta.arguments:
            events.append(blocks.delta({"type": "input_json_delta", "partial_json": delta.arguments}))
    return events
