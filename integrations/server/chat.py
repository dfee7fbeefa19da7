"""POST /v1/chat/completions: messages through the chat template, answers with optional tool calls."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend import RequestOutput

from ..hermes import CallDelta, CallStream, new_call_id
from ..logprobs import chat_logprobs, positions
from ..structured import add_json_instruction
from .chat_template import render_chat
from .errors import APIError, request_field
from .fanout import Job, collect_finals, merge_streams, new_id
from .protocol import ChatCompletionRequest
from .responses import DONE, sse, sse_error, usage
from .sampling import bias_processor, check_prompt, to_sampling_params, with_choices
from .state import ServerState
from .structured import structured_spec
from .tool_calls import ToolCall, ToolCallStreamer, parse_tool_calls


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, http_request: Request):
    body.check_supported()
    lora = state.check_model(body.model)
    state.check_sequences(1, body.n, "n")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.uses_tools else None
    structured = structured_spec(body, tools)
    messages = body.messages
    if body.wants_json and not body.forces_tool:
        schema = (body.json_schema or {}).get("schema")
        messages = add_json_instruction(messages, schema if isinstance(schema, dict) else None)
    with request_field("messages"):
        prompt_ids = render_chat(state.tokenizer, messages, tools, body.add_generation_prompt,
                                 body.chat_template_kwargs)
    params = to_sampling_params(body, body.output_limit, logprobs_wanted(body), structured)
    prompt_ids = check_prompt(state.client, prompt_ids, params, "messages")
    request_id = new_id("chatcmpl")
    jobs = [Job(0, prompt_ids, with_choices(params, body.n), bias_processor(state.client, body.logit_bias), lora)]
    if body.stream:
        events = stream_chat(state, body, jobs, len(prompt_ids), request_id)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await collect_finals(http_request, state.client, jobs, request_id, state.metrics)
    choices = [chat_choice(state, body, i, finals[i]) for i in range(body.n)]
    completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals.values())
    response = envelope(request_id, body.model, "chat.completion", choices)
    return JSONResponse(response | {"usage": usage(len(prompt_ids), completion_tokens)})


def logprobs_wanted(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


def envelope(request_id: str, model: str, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def chat_choice(state: ServerState, body: ChatCompletionRequest, index: int, output: RequestOutput) -> dict[str, Any]:
    completion = output.outputs[0]
    content, calls = split_answer(body, completion.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    logprobs = chat_logprobs(state.tokenizer, positions(completion), body.top_logprobs or 0) if body.logprobs else None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": "tool_calls" if calls else completion.finish_reason,
            "stop_reason": completion.stop_reason}


def split_answer(body: ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    if not body.uses_tools:
        return text, []
    content, calls = parse_tool_calls(text)
    return content, calls if body.parallel_tool_calls else calls[:1]


async def stream_chat(state: ServerState, body: ChatCompletionRequest, jobs: list[Job], prompt_tokens: int,
                      request_id: str) -> AsyncIterator[str]:
    generated = [0] * body.n

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        event = envelope(request_id, body.model, "chat.completion.chunk", [choice])
        if body.continuous_usage:
            event["usage"] = usage(prompt_tokens, sum(generated))
        return sse(event)

    streamers = [ToolCallStreamer() if body.uses_tools else None for _ in range(body.n)]
    # A forced call is held to the grammar, so it is a call from its first token: stream it as it comes.
    call_streams = [CallStream() if body.forces_tool else None for _ in range(body.n)]
    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, output in merge_streams(state.client, jobs, request_id, state.metrics):
        if output.error:
            yield sse_error(APIError(500, f"generation failed: {output.error}"))
            return
        generated[index] = len(output.outputs[0].token_ids)
        streamer = streamers[index]
        text = streamer.push(output.delta_text) if streamer else output.delta_text
        logprobs = stream_logprobs(state, body, output)
        if text or logprobs:
            yield chunk(index, {"content": text}, logprobs=logprobs)
        if call_streams[index] is not None and not output.finished:
            deltas = call_streams[index].update(streamer.text)
            if deltas:
                yield chunk(index, {"tool_calls": [call_delta(d) for d in deltas]})
        if output.finished:
            for event in final_chunks(body, index, output, streamer, chunk, call_streams[index]):
                yield event
    if body.include_usage:
        yield sse(envelope(request_id, body.model, "chat.completion.chunk", [])
                  | {"usage": usage(prompt_tokens, sum(generated))})
    yield DONE


def stream_logprobs(state: ServerState, body: ChatCompletionRequest, output: RequestOutput) -> dict[str, Any] | None:
    if not body.logprobs or not output.delta_token_ids:
        return None
    pairs = positions(output.outputs[0], len(output.delta_token_ids))
    return chat_logprobs(state.tokenizer, pairs, body.top_logprobs or 0)


def final_chunks(body: ChatCompletionRequest, index: int, output: RequestOutput, streamer: ToolCallStreamer | None,
                 chunk, call_stream: CallStream | None) -> list[str]:
    """The tail of one choice: any held-back content, the tool calls (or, for calls that streamed,
    their last pieces), then the finish reason."""
    events = []
    finish_reason = output.outputs[0].finish_reason
    if streamer is not None:
        rest, calls = streamer.finish()
        calls = calls if body.parallel_tool_calls else calls[:1]
        if call_stream is not None and call_stream.streamed:
            deltas = [call_delta(d) for d in call_stream.update(streamer.text)]
            rest = ""  # the held-back text was the calls, already sent as such
        else:
            deltas = [dict(call.to_openai(), index=k) for k, call in enumerate(calls)]
        if rest:
            events.append(chunk(index, {"content": rest}))
        if deltas:
            events.append(chunk(index, {"tool_calls": deltas}))
        if calls:
            finish_reason = "tool_calls"
    events.append(chunk(index, {}, finish_reason))
    return events


def call_delta(delta: CallDelta) -> dict[str, Any]:
    """OpenAI's shape of a streamed call piece: the first carries the call's id, type and name."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": new_call_id(), "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}
