"""POST /v1/chat/completions: messages through the chat template, answers with optional reasoning
(`message.reasoning`, also as `reasoning_content`) and tool calls in the served model's format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend.core.outputs import RequestOutput

from paged_backend.entrypoints.answer_reader import AnswerReader, AnswerStream, cut_off
from paged_backend.entrypoints.tool_calls.answer_calls import ToolCall
from paged_backend.entrypoints.tool_calls.base import CallDelta, new_call_id
from ..logprobs import chat_logprobs, positions
from .chat_turn import TurnFields, check_tools, route_turn
from .errors import APIError
from .fanout import Job, collect_finals, merge_streams, new_id
from .protocol import ChatCompletionRequest
from .responses import DONE, sse, sse_error, usage
from .sampling import (
    bias_processor,
    then,
    to_sampling_params,
    with_choices,
)
from .state import ServerState
from .structured_request import structured_spec


CHAT_FIELDS = TurnFields()


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, http_request: Request):
    body.check_supported()
    lora = state.check_model(body.model)
    state.check_sequences(1, body.n, "n")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.uses_tools else None
    check_tools(tools, "tools.{}.function.parameters")
    structured = structured_spec(body, tools)
    params = to_sampling_params(body, body.output_limit, logprobs_wanted(body), structured)
    response_format = body.response_format.model_dump() if body.response_format is not None else None
    turn = route_turn(state, body.messages, params, CHAT_FIELDS, tools=tools, tool_choice=body.tool_choice,
                      parallel_tool_calls=body.parallel_tool_calls, response_format=response_format,
                      split_reasoning=body.include_reasoning, thinking_budget=body.thinking_token_budget,
                      add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs)
    reader, prompt_ids = turn.reader, turn.prompt_ids
    processor = then(bias_processor(state.client, body.logit_bias), turn.processor)
    request_id = new_id("chatcmpl")
    jobs = [Job(0, prompt_ids, with_choices(turn.params, body.n), processor, lora, turn.images)]
    if body.stream:
        events = stream_chat(state, body, reader, jobs, len(prompt_ids), request_id)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await collect_finals(http_request, state.client, jobs, request_id, state.metrics)
    choices = [chat_choice(state, body, reader, i, finals[i]) for i in range(body.n)]
    completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals.values())
    thought = sum(reader.reasoning_tokens(state.tokenizer, out.outputs[0].token_ids) for out in finals.values())
    response = envelope(request_id, body.model, "chat.completion", choices)
    return JSONResponse(response | {"usage": chat_usage(reader, len(prompt_ids), completion_tokens, thought)})


def chat_usage(reader: AnswerReader, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    counted = usage(prompt_tokens, completion_tokens)
    if reader.reasoning is not None:
        counted["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counted


def logprobs_wanted(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


def envelope(request_id: str, model: str, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def chat_choice(state: ServerState, body: ChatCompletionRequest, reader: AnswerReader, index: int,
                output: RequestOutput) -> dict[str, Any]:
    completion = output.outputs[0]
    reasoning, content, calls = reader.split(reader.answer_of(completion), cut_off(completion))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reader.reasoning is not None:
        message |= {"reasoning": reasoning, "reasoning_content": reasoning}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    logprobs = chat_logprobs(state.tokenizer, positions(completion), body.top_logprobs or 0) if body.logprobs else None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(completion, calls),
            "stop_reason": completion.stop_reason}


async def stream_chat(state: ServerState, body: ChatCompletionRequest, reader: AnswerReader, jobs: list[Job],
                      prompt_tokens: int, request_id: str) -> AsyncIterator[str]:
    generated = [0] * body.n
    thought = [0] * body.n

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        event = envelope(request_id, body.model, "chat.completion.chunk", [choice])
        if body.continuous_usage:
            event["usage"] = usage(prompt_tokens, sum(generated))
        return sse(event)

    streams = [reader.stream() for _ in range(body.n)]
    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, output in merge_streams(state.client, jobs, request_id, state.metrics):
        if output.error:
            yield sse_error(APIError(500, f"generation failed: {output.error}"))
            return
        generated[index] = len(output.outputs[0].token_ids)
        pieces = streams[index].push(reader.delta_of(output))
        logprobs = stream_logprobs(state, body, output)
        for delta in reasoning_deltas(pieces.reasoning):
            yield chunk(index, delta)
        if pieces.content or logprobs:
            yield chunk(index, {"content": pieces.content}, logprobs=logprobs)
        calls = [call_piece(d) for d in pieces.calls]
        if calls and not output.finished:
            yield chunk(index, {"tool_calls": calls})
        if output.finished:
            thought[index] = reader.reasoning_tokens(state.tokenizer, output.outputs[0].token_ids)
            for event in final_chunks(index, output, streams[index], calls, chunk):
                yield event
    if body.include_usage:
        yield sse(envelope(request_id, body.model, "chat.completion.chunk", [])
                  | {"usage": chat_usage(reader, prompt_tokens, sum(generated), sum(thought))})
    yield DONE


def reasoning_deltas(text: str) -> list[dict[str, Any]]:
    return [{"reasoning": text, "reasoning_content": text}] if text else []


def stream_logprobs(state: ServerState, body: ChatCompletionRequest, output: RequestOutput) -> dict[str, Any] | None:
    if not body.logprobs or not output.delta_token_ids:
        return None
    pairs = positions(output.outputs[0], len(output.delta_token_ids))
    return chat_logprobs(state.tokenizer, pairs, body.top_logprobs or 0)


def final_chunks(index: int, output: RequestOutput, stream: AnswerStream, pending_calls: list[dict[str, Any]],
                 chunk) -> list[str]:
    """The tail of one choice: any held-back reasoning and content, the tool calls (or, for calls that
    streamed, their last pieces), then the finish reason."""
    pieces = stream.finish(cut_off(output.outputs[0]))
    events = [chunk(index, delta) for delta in reasoning_deltas(pieces.reasoning)]
    if pieces.content:
        events.append(chunk(index, {"content": pieces.content}))
    calls = pending_calls + [call_piece(d) for d in pieces.calls]
    calls += [dict(call.to_openai(), index=pieces.streamed + k) for k, call in enumerate(pieces.unsent_calls)]
    if calls:
        events.append(chunk(index, {"tool_calls": calls}))
    events.append(chunk(index, {}, finish_reason(output.outputs[0], pieces.tool_calls)))
    return events


def finish_reason(completion: Any, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish reason: `tool_calls` for an answer that ended with calls, but `length` for
    one max_tokens cut, whose last call may be unfinished."""
    return "tool_calls" if calls and not cut_off(completion) else completion.finish_reason


def call_piece(delta: CallDelta) -> dict[str, Any]:
    """OpenAI's shape of a streamed call piece: the first carries the call's id, type and name."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": new_call_id(), "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", dependencies=state.authorised())
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)
