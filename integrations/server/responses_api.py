"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A request becomes a chat conversation (`previous_response_id`'s stored conversation, `instructions` as
the system turn, `input` as text or items: messages, function calls and their outputs), built into the
same chat turn as /v1/chat/completions builds (`paged_backend/entrypoints/chat_turn.py`): function tools and
`tool_choice` get its tool policy and grammar in the server's tool-call format, `text.format` its response
format. The answer is read by the turn's reader (the server's reasoning parser and tool-call format) into
output items (a reasoning item when the model thought, a message, function
calls), returned whole or streamed as the SDK's events (`response.created` ... `response.completed`,
`response.reasoning_text.delta` for the thinking). `reasoning.summary` (auto, concise, detailed) moves the
thinking, verbatim, from the item's content to its summary (streamed as `response.reasoning_summary_text.delta`):
this server makes no shorter summary, and clients that show only summaries (LangChain's ChatOpenAI) then
show the thinking. `reasoning.effort` "none" turns a reasoning model's thinking off
(`thinking.thinking_switch`); other efforts name levels this server has no means to set and are refused, like built-in tools (web search, file search, ...) and other features this server cannot
run, with a 400 naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from paged_backend.core.outputs import RequestOutput

from paged_backend.entrypoints.answer_reader import AnswerReader, Pieces, cut_off
from paged_backend.entrypoints.structured import chosen_tool_name
from paged_backend.image_sources import is_image_part
from paged_backend.entrypoints.tool_calls.answer_calls import ToolCall
from paged_backend.entrypoints.tool_calls.base import CallDelta, new_call_id
from .chat_turn import TurnFields, check_tools, route_turn
from .errors import APIError, bad_request, not_supported, request_field
from .fanout import Job, collect_finals, merge_streams
from .protocol import STRICT, OpenAISamplingOptions, Tool
from .response_store import ResponseStore
from .sampling import to_sampling_params
from .state import ServerState
from .thinking import Thinking, thinking_switch

# Fields OpenAI defines that this server takes only at the value that changes nothing: (accepted, why).
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "responses are answered while the request waits"),
    "conversation": ((None,), "use previous_response_id to continue a conversation"),
    "prompt": ((None,), "no stored prompt templates"),
    "include": ((None, []), "no extra output data to include"),
    "max_tool_calls": ((None,), "tool calls are limited by parallel_tool_calls"),
    "top_logprobs": ((None, 0), "no logprobs on this route; /v1/chat/completions returns them"),
    "truncation": ((None, "disabled"), "a conversation longer than the context is refused, not truncated"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "stream events are never obfuscated"),
}
CONTENT_TEXT = frozenset({"input_text", "output_text", "text", "refusal"})


class ResponsesRequest(OpenAISamplingOptions):
    """The Responses API's create body; the OPENAI table's sampling options (temperature, top_p, and vLLM's
    extras such as top_k and seed) are inherited."""

    model_config = STRICT
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None  # the caller's own bookkeeping: they change no output
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None

    neutral: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NEUTRAL

    def check_supported(self) -> None:
        for name, (accepted, why) in self.neutral.items():
            if getattr(self, name) not in accepted:
                raise not_supported(name, why)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")


@dataclass(slots=True)
class Turn:
    """One request, translated: what the engine runs and what the response echoes."""

    body: ResponsesRequest
    response_id: str
    created_at: int
    conversation: list[dict[str, Any]]  # without instructions: what the store keeps
    tools: list[dict[str, Any]] | None  # chat-shaped, for the renderer and the tool grammar
    tool_choice: Any  # chat-shaped
    text_format: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    reader: AnswerReader = field(default_factory=AnswerReader)
    as_summary: bool = False  # the thinking goes to the reasoning item's summary (reasoning.summary)

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool(self) -> bool:
        return self.uses_tools and chosen_tool_name(self.tools, self.tool_choice) is not None


def add_routes(app: FastAPI, state: ServerState) -> None:
    store: ResponseStore = app.state.responses  # what previous_response_id reads back

    @app.post("/v1/responses", dependencies=state.authorised())
    async def create(body: ResponsesRequest, request: Request):
        return await create_response(state, store, body, request)

    @app.get("/v1/responses/{response_id}", dependencies=state.authorised())
    async def retrieve(response_id: str) -> JSONResponse:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"No response found with id '{response_id}'.", "response_id", "not_found")
        return JSONResponse(entry.response)

    @app.delete("/v1/responses/{response_id}", dependencies=state.authorised())
    async def delete(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise APIError(404, f"No response found with id '{response_id}'.", "response_id", "not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def create_response(state: ServerState, store: ResponseStore, body: ResponsesRequest, http_request: Request):
    body.check_supported()
    lora = state.check_model(body.model)
    turn = translate(body, store, images=state.client.image_prompts is not None)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + turn.conversation
    thinking = reasoning_thinking(state, body.reasoning)
    turn.as_summary = summary_wanted(body.reasoning)
    params = to_sampling_params(body, body.max_output_tokens, None)
    chat_turn = route_turn(state, messages, params, RESPONSES_FIELDS, tools=turn.tools, tool_choice=turn.tool_choice,
                           parallel_tool_calls=body.parallel_tool_calls, response_format=response_format(turn),
                           thinking_budget=thinking.budget, template_kwargs=thinking.template_kwargs)
    turn.prompt_ids, turn.reader = chat_turn.prompt_ids, chat_turn.reader
    jobs = [Job(0, turn.prompt_ids, chat_turn.params, chat_turn.processor, lora, chat_turn.images)]
    if body.stream:
        return StreamingResponse(stream_response(state, store, turn, jobs), media_type="text/event-stream")
    finals = await collect_finals(http_request, state.client, jobs, turn.response_id, state.metrics)
    final = finals[0]
    reasoning, content, calls = turn.reader.split(turn.reader.answer_of(final.outputs[0]), cut_off(final.outputs[0]))
    output = output_items(reasoning, content, calls, item_status(final), turn.as_summary)
    response = response_object(turn, output, final, usage=response_usage(state, turn.reader, final))
    remember(store, turn, response, content)
    return JSONResponse(response)


def reasoning_thinking(state: ServerState, reasoning: dict[str, Any] | None) -> Thinking:
    """`reasoning`: effort "none" turns the thinking off; other efforts are refused (no means to set a
    level here); a summary is accepted (`summary_wanted`)."""
    reasoning = reasoning or {}
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise bad_request(f"unrecognized request argument supplied: reasoning.{min(unknown)}",
                          f"reasoning.{min(unknown)}")
    if all(value is None for value in reasoning.values()):
        return Thinking()
    if state.reasoning_parser is None:
        raise not_supported("reasoning", "no reasoning options: this server runs no reasoning parser "
                            "(--reasoning-parser)")
    effort = reasoning.get("effort")
    if effort not in (None, "none"):
        raise not_supported("reasoning.effort", f"{effort!r}: this server can turn the thinking off ('none') "
                            "but sets no effort level; leave effort out for the model's own thinking")
    return thinking_switch(state, False, "reasoning.effort") if effort == "none" else Thinking()


SUMMARIES = ("auto", "concise", "detailed")


def summary_wanted(reasoning: dict[str, Any] | None) -> bool:
    """Whether `reasoning.summary` (or its older name `generate_summary`) asks for a summary; 400 for a kind
    OpenAI does not define."""
    wanted = False
    for key in ("summary", "generate_summary"):
        value = (reasoning or {}).get(key)
        if value is not None and value not in SUMMARIES:
            raise bad_request(f"reasoning.{key} must be one of {list(SUMMARIES)}, got {value!r}", f"reasoning.{key}")
        wanted = wanted or value is not None
    return wanted


RESPONSES_FIELDS = TurnFields(messages="input", response_format="text.format", thinking_budget="reasoning",
                              read=frozenset({"tools", "response_format"}))


# ------------------------------------------------------------------ the request as a conversation


def translate(body: ResponsesRequest, store: ResponseStore, images: bool = False) -> Turn:
    """The request as a turn; `images`: the engine takes `input_image` parts (else they are refused)."""
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        entry = store.get(body.previous_response_id)
        if entry is None:
            raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found (it never "
                           "existed, was stored with store=false, or was evicted from this server's store).",
                           "previous_response_id", "previous_response_not_found")
        earlier = entry.conversation
    tools = chat_tools(body.tools)
    check_tools(tools, "tools.{}.parameters")
    return Turn(body=body, response_id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()),
                conversation=earlier + input_messages(body.input, images), tools=tools,
                tool_choice=chat_tool_choice(body.tool_choice, tools), text_format=text_format(body.text))


def input_messages(items: str | list[dict[str, Any]], images: bool = False) -> list[dict[str, Any]]:
    """`input` as chat messages: text is one user turn; function calls join the assistant turn before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(message_of(item, i, images))
        elif kind == "function_call":
            add_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": required(item, "call_id", i),
                             "content": text_of(item.get("output"), f"input.{i}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: chat templates leave it out of later prompts too
        else:
            raise not_supported(f"input.{i}.type", f"item type {kind!r}; this server takes messages, "
                                "function_call and function_call_output items")
    return messages


def message_of(item: dict[str, Any], index: int, images: bool = False) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"input[{index}].role must be user, assistant, system or developer, got {role!r}",
                          f"input.{index}.role")
    content = item.get("content")
    if images and role == "user" and isinstance(content, list) and any(is_image_part(p) for p in content):
        return {"role": role, "content": [part if is_image_part(part) else
                                          {"type": "text", "text": text_of([part], f"input.{index}.content")}
                                          for part in content]}
    return {"role": role, "content": text_of(content, f"input.{index}.content")}


def text_of(content: Any, where: str) -> str:
    """A string, or content parts of text (input_text, output_text): other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in CONTENT_TEXT:
            raise not_supported(f"{where}.{j}", f"content part of type {kind!r}: this is a text-only model")
        texts.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(texts)


def add_call(messages: list[dict[str, Any]], item: dict[str, Any], index: int) -> None:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request(f"input[{index}].arguments must be a JSON string", f"input.{index}.arguments")
    call = {"id": required(item, "call_id", index), "type": "function",
            "function": {"name": required(item, "name", index), "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def required(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"input[{index}].{key} must be a non-empty string", f"input.{index}.{key}")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape; built-in tools are refused naming the tool."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise not_supported(f"tools.{i}.type", f"built-in tool {kind!r}: only function tools run on this server")
        spec = {key: value for key, value in tool.items() if key != "type"}
        with request_field(f"tools.{i}"):
            converted.append(Tool.model_validate({"type": "function", "function": spec}).model_dump(exclude_none=True))
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        choice = {"type": "function", "function": {"name": choice["name"]}}
        try:
            chosen_tool_name(tools or [], choice)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from None
        return choice
    raise not_supported("tool_choice", f"{choice!r}: give 'none', 'auto', 'required' or "
                        "{'type': 'function', 'name': ...}")


def text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format`: {"type": "text"} (the default), json_object, or json_schema with its `schema`."""
    text = text or {}
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        first = min(unknown)
        raise bad_request(f"unrecognized request argument supplied: text.{first}", f"text.{first}")
    if text.get("verbosity") not in (None, "medium"):
        raise not_supported("text.verbosity", "only 'medium'")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be text, json_object or json_schema", "text.format")
    return fmt


def response_format(turn: Turn) -> dict[str, Any] | None:
    """`text.format` as the chat turn's response format (None for text); a 400 when a forced tool call
    asks for the answer too."""
    fmt = turn.text_format
    if turn.forces_tool and fmt["type"] != "text":
        raise bad_request("text.format asks for JSON while tool_choice forces a tool call; give one", "text.format")
    if fmt["type"] == "text":
        return None
    wire = {"type": fmt["type"]}
    if fmt["type"] == "json_schema":
        wire["json_schema"] = {"schema": fmt.get("schema")}
    return wire


# ------------------------------------------------------------------ the answer as a response


def item_status(final: RequestOutput) -> str:
    return "incomplete" if final.outputs[0].finish_reason == "length" else "completed"


def output_items(reasoning: str | None, content: str | None, calls: list[ToolCall],
                 status: str, as_summary: bool = False) -> list[dict[str, Any]]:
    """A reasoning item when the model thought (in words), the message, then the function calls."""
    items = [reasoning_item(new_item_id("rs"), reasoning, "completed", as_summary)] if reasoning else []
    if content or not calls:
        items.append(message_item(new_item_id("msg"), content or "", status))
    items += [call_item(new_item_id("fc"), call, call_status(call)) for call in calls]
    return items


def reasoning_item(item_id: str, text: str, status: str, as_summary: bool = False) -> dict[str, Any]:
    """The SDK's ResponseReasoningItem: the thinking whole as its content, or as its summary when one was
    asked for (no shorter summary is made)."""
    done = status != "in_progress"
    if as_summary:
        return {"id": item_id, "type": "reasoning", "summary": [summary_text(text)] if done else [], "status": status}
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [reasoning_text(text)] if done else []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def summary_text(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_status(call: ToolCall) -> str:
    """A call cut off by max_tokens is an incomplete item, as the message it ends would be."""
    return "completed" if call.complete else "incomplete"


def call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def response_object(turn: Turn, output: list[dict[str, Any]], final: RequestOutput | None,
                    status: str | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    body = turn.body
    if status is None:
        status = "completed" if final is None or final.outputs[0].finish_reason != "length" else "incomplete"
    return {
        "id": turn.response_id, "object": "response", "created_at": turn.created_at, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "model": body.model, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "text": {"format": turn.text_format}, "store": body.store,
        "metadata": body.metadata or {}, "user": body.user, "reasoning": body.reasoning or None,
        "truncation": "disabled", "usage": usage,
    }


def response_usage(state: ServerState, reader: AnswerReader, final: RequestOutput) -> dict[str, Any]:
    prompt, generated = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    thought = reader.reasoning_tokens(state.tokenizer, final.outputs[0].token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": prompt + generated}


def remember(store: ResponseStore, turn: Turn, response: dict[str, Any], content: str | None) -> None:
    """Keep the response and its conversation, its own answer included, for a later previous_response_id
    (its thinking left out, as chat templates leave earlier turns' thinking out of later prompts)."""
    if not turn.body.store:
        return
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        reply["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    store.put(response, turn.conversation + [reply])


# ------------------------------------------------------------------ streaming


class EventWriter:
    """Numbers the stream's events and frames them as SSE (`event:` and `data:` lines, as OpenAI sends)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class OpenItem:
    """An item whose text is streaming (the message, or the reasoning): its place in `output`, its text."""

    item_id: str
    output_index: int
    text: str = ""


class OutputStream:
    """The response's output items as the answer streams: the reasoning item while the model thinks
    (closed when the answer begins), the message as its text comes, forced calls as they are written."""

    def __init__(self, event: EventWriter, as_summary: bool = False) -> None:
        self.event = event
        self.as_summary = as_summary  # the thinking streams as the item's summary, not its content
        self.output: list[dict[str, Any]] = []
        self.thought: OpenItem | None = None
        self.message: OpenItem | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # forced calls streaming: call index -> its open item
        self.reasoning = ""  # the whole thinking streamed
        self.content = ""  # the whole content streamed

    def take(self, piece: Pieces) -> list[str]:
        events = self.add_reasoning(piece.reasoning) if piece.reasoning else []
        if piece.content or piece.calls:
            events += self.close_reasoning()
        events += piece_events(self.event, piece.calls, self.output, self.calls)
        if piece.content:
            events += self.add_text(piece.content)
        return events

    def add_reasoning(self, text: str) -> list[str]:
        events = []
        if self.thought is None:
            self.thought = OpenItem(new_item_id("rs"), len(self.output))
            item = reasoning_item(self.thought.item_id, "", "in_progress", self.as_summary)
            self.output.append(item)
            events += [self.event("response.output_item.added", output_index=self.thought.output_index, item=item),
                       self.event(self.part_event("added"), **self.where(self.thought), part=self.part(""))]
        self.thought.text += text
        self.reasoning += text
        kind = "response.reasoning_summary_text.delta" if self.as_summary else "response.reasoning_text.delta"
        events.append(self.event(kind, **self.where(self.thought), delta=text))
        return events

    def where(self, thought: OpenItem) -> dict[str, Any]:
        """Where a piece of the thinking goes: the summary's first part, or the content's."""
        index = {"summary_index": 0} if self.as_summary else {"content_index": 0}
        return {"item_id": thought.item_id, "output_index": thought.output_index, **index}

    def part_event(self, stage: str) -> str:
        return f"response.reasoning_summary_part.{stage}" if self.as_summary else f"response.content_part.{stage}"

    def part(self, text: str) -> dict[str, Any]:
        return summary_text(text) if self.as_summary else reasoning_text(text)

    def close_reasoning(self) -> list[str]:
        thought, self.thought = self.thought, None
        if thought is None:
            return []
        item = reasoning_item(thought.item_id, thought.text, "completed", self.as_summary)
        self.output[thought.output_index] = item
        done = "response.reasoning_summary_text.done" if self.as_summary else "response.reasoning_text.done"
        return [self.event(done, **self.where(thought), text=thought.text),
                self.event(self.part_event("done"), **self.where(thought), part=self.part(thought.text)),
                self.event("response.output_item.done", output_index=thought.output_index, item=item)]

    def add_text(self, text: str) -> list[str]:
        """Stream `text` into the message item, opening it first when this is the answer's first text."""
        events = []
        if self.message is None:
            self.message = OpenItem(new_item_id("msg"), len(self.output))
            self.output.append(message_item(self.message.item_id, "", "in_progress"))
            events += open_message(self.event, self.message)
        if text:
            self.message.text += text
            self.content += text
            events.append(self.event("response.output_text.delta", item_id=self.message.item_id,
                                     output_index=self.message.output_index, content_index=0, delta=text, logprobs=[]))
        return events

    def finish(self, rest: Pieces, status: str) -> list[str]:
        """The answer's end: what was held back, the items closed, the calls (streamed or sent whole)."""
        events = self.add_reasoning(rest.reasoning) if rest.reasoning else []
        events += self.close_reasoning()
        if rest.content or (self.message is None and not rest.tool_calls):  # an empty answer is an empty message
            events += self.add_text(rest.content)
        if self.message is not None:
            events += close_message(self.event, self.message, self.output, status)
        events += piece_events(self.event, rest.calls, self.output, self.calls)
        for k, call in enumerate(rest.tool_calls):
            events += close_call(self.event, k, call, self.output, self.calls)
        return events


async def stream_response(state: ServerState, store: ResponseStore, turn: Turn, jobs: list[Job]) -> AsyncIterator[str]:
    event = EventWriter()
    yield event("response.created", response=response_object(turn, [], None, "in_progress"))
    yield event("response.in_progress", response=response_object(turn, [], None, "in_progress"))
    reader = turn.reader
    stream = reader.stream()
    items = OutputStream(event, turn.as_summary)
    final: RequestOutput | None = None
    async for _, out in merge_streams(state.client, jobs, turn.response_id, state.metrics):
        if out.error:
            yield event("error", code="server_error", message=f"generation failed: {out.error}", param=None)
            return
        if out.finished:
            final = out
        for text in items.take(stream.push(reader.delta_of(out))):
            yield text
    for text in items.finish(stream.finish(cut_off(final.outputs[0])), item_status(final)):
        yield text
    response = response_object(turn, items.output, final, usage=response_usage(state, reader, final))
    remember(store, turn, response, items.content if items.message else None)
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                response=response)


def open_message(event: EventWriter, message: OpenItem) -> list[str]:
    return [event("response.output_item.added", output_index=message.output_index,
                  item=message_item(message.item_id, "", "in_progress")),
            event("response.content_part.added", item_id=message.item_id, output_index=message.output_index,
                  content_index=0, part=output_text(""))]


def close_message(event: EventWriter, message: OpenItem, output: list[dict[str, Any]], status: str) -> list[str]:
    item = message_item(message.item_id, message.text, status)
    output[message.output_index] = item
    return [event("response.output_text.done", item_id=message.item_id, output_index=message.output_index,
                  content_index=0, text=message.text, logprobs=[]),
            event("response.content_part.done", item_id=message.item_id, output_index=message.output_index,
                  content_index=0, part=output_text(message.text)),
            event("response.output_item.done", output_index=message.output_index, item=item)]


def piece_events(event: EventWriter, deltas: list[CallDelta], output: list[dict[str, Any]],
                 calls: dict[int, dict[str, Any]]) -> list[str]:
    """A forced call's pieces: its item opens with its name, then its arguments stream. A call ends where
    the next one begins, so the open one closes first: items stream one at a time, each whole before the
    next opens, as OpenAI streams them (a client rendering items in order sees complete ones)."""
    events = []
    for delta in deltas:
        if delta.name is not None and delta.index not in calls:
            events += close_streamed(event, output, calls)
            item = {"id": new_item_id("fc"), "type": "function_call", "call_id": new_call_id(), "name": delta.name,
                    "arguments": "", "status": "in_progress"}
            calls[delta.index] = item | {"output_index": len(output), "streamed": "", "closed": False}
            output.append(item)
            events.append(event("response.output_item.added", output_index=len(output) - 1, item=item))
        if delta.arguments:
            open_item = calls[delta.index]
            open_item["streamed"] += delta.arguments
            events.append(event("response.function_call_arguments.delta", item_id=open_item["id"],
                                output_index=open_item["output_index"], delta=delta.arguments))
    return events


def close_streamed(event: EventWriter, output: list[dict[str, Any]], calls: dict[int, dict[str, Any]]) -> list[str]:
    """Close the streamed calls still open: a later call began, so they were written whole."""
    events = []
    for open_item in calls.values():
        if not open_item["closed"]:
            call = ToolCall(open_item["name"], open_item["streamed"], open_item["call_id"])
            events += end_call(event, open_item["id"], open_item["output_index"], call, output)
            open_item["closed"] = True
    return events


def close_call(event: EventWriter, index: int, call: ToolCall, output: list[dict[str, Any]],
               calls: dict[int, dict[str, Any]]) -> list[str]:
    """A call's last events: a call that streamed closes (under the id it streamed with) unless the next
    call closed it already; one that did not is sent whole."""
    if index in calls:  # its arguments as they streamed (the grammar held them to JSON), not re-serialised
        open_item = calls[index]
        if open_item["closed"]:
            return []
        open_item["closed"] = True
        call = ToolCall(call.name, open_item["streamed"], open_item["call_id"], call.complete)
        return end_call(event, open_item["id"], open_item["output_index"], call, output)
    item_id, output_index = new_item_id("fc"), len(output)
    output.append({})
    return [event("response.output_item.added", output_index=output_index,
                  item=call_item(item_id, ToolCall(call.name, "", call.id), "in_progress")),
            event("response.function_call_arguments.delta", item_id=item_id, output_index=output_index,
                  delta=call.arguments),
            *end_call(event, item_id, output_index, call, output)]


def end_call(event: EventWriter, item_id: str, output_index: int, call: ToolCall,
             output: list[dict[str, Any]]) -> list[str]:
    """The item's arguments done and the item done, in its place in `output`."""
    item = call_item(item_id, call, call_status(call))
    output[output_index] = item
    return [event("response.function_call_arguments.done", item_id=item_id, output_index=output_index,
                  name=call.name, arguments=call.arguments),
            event("response.output_item.done", output_index=output_index, item=item)]
