"""Forced tool calls (`tool_choice` "required" or a named function) and `response_format` json_schema:
the shared guided-JSON writers write the structure and the model fills in each value, one engine
request per value, each held to its value's token rule. The answer is known only when the last value
is written, so a streamed reply carries it in one chunk."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from paged_backend import RequestOutput, SamplingParams
from paged_backend.request import LogitsProcessor

from ..guided_json import (
    UnsupportedSchema,
    Writer,
    choose_writer,
    default_answer,
    value_params,
    value_processor,
    vocab_for,
)
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest
from .responses import DONE, sse, sse_error, usage
from .sampling import then
from .state import ServerState
from .tool_calls import parse_tool_calls


@dataclass(slots=True)
class GuidedAnswer:
    text: str
    completion_tokens: int
    spent: bool  # max_tokens ran out: the last values were written without the model


def guided_writer(body: ChatCompletionRequest,
                  tools: list[dict[str, Any]] | None) -> Callable[[], Writer] | None:
    """The writer this request needs, or None; a request it cannot honour is a 400 naming why."""
    response_format = body.response_format.model_dump() if body.response_format is not None else None
    try:
        writer = choose_writer(tools or [], body.tool_choice, response_format)
    except UnsupportedSchema as exc:
        raise bad_request(f"guided JSON cannot follow {exc}",
                          "tools" if body.forces_tool else "response_format") from None
    except ValueError as exc:  # a named tool_choice that names no tool
        raise bad_request(str(exc), "tool_choice") from None
    return writer


async def write_choices(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                        make_writer: Callable[[], Writer], request_id: str, n: int,
                        bias: LogitsProcessor | None = None) -> list[GuidedAnswer]:
    """n guided answers written side by side (their value requests share the engine's batches); choice i
    samples as the single request seeded seed + i does. If one fails, the others are cancelled."""
    samples = [params] if n == 1 else [params.for_sample(i) for i in range(n)]
    tasks = [asyncio.ensure_future(write_guided(state, prompt_ids, p, make_writer(), f"{request_id}-{i}", bias))
             for i, p in enumerate(samples)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # after a failure, stop the others (a finished task ignores this)
            task.cancel()


async def write_guided(state: ServerState, prompt_ids: list[int], params: SamplingParams, writer: Writer,
                       request_id: str, bias: LogitsProcessor | None = None) -> GuidedAnswer:
    """Run the writer, each value one engine request on the prompt plus the text written so far."""
    vocab = vocab_for(state.tokenizer)
    generated, spent = 0, False
    try:
        ask = next(writer)
        # Ends: every value the model writes uses up max_tokens or grows the prompt towards the context
        # check below, and once max_tokens is spent the default answers close the JSON.
        for step in itertools.count():
            value = value_params(ask, params, generated)
            if value is None:  # max_tokens is spent: the value is written without the model, so the JSON closes
                spent = True
                ask = writer.send(default_answer(ask))
                continue
            ids = prompt_ids + state.tokenizer(ask.text, add_special_tokens=False)["input_ids"]
            if len(ids) + (value.max_tokens or 1) > state.engine.max_model_len:
                raise APIError(400, "the guided answer outgrew the model's context length", "max_tokens")
            # The caller's logit_bias shapes the model's preference; the rule then keeps the value valid.
            processor = then(bias, None if ask.rule is None else value_processor(ask.rule, vocab))
            final = await last_output(state.aengine.generate(ids, value, f"{request_id}-{step}", processor))
            state.metrics.record_finished(final)
            if final.error:
                raise APIError(500, f"generation failed: {final.error}")
            generated += len(final.outputs[0].token_ids)
            ask = writer.send(final.outputs[0].text)
    except StopIteration as end:
        return GuidedAnswer(end.value, generated, spent)


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for final in outputs:
        pass
    return final


def guided_message(body: ChatCompletionRequest, answer: GuidedAnswer) -> tuple[dict[str, Any], str]:
    """The assistant message (a tool call, or JSON content) and its finish reason."""
    if not body.forces_tool:
        return {"role": "assistant", "content": answer.text}, "length" if answer.spent else "stop"
    _, calls = parse_tool_calls(answer.text)
    message = {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]}
    return message, "length" if answer.spent else "tool_calls"


def guided_choice(body: ChatCompletionRequest, answer: GuidedAnswer, index: int) -> dict[str, Any]:
    message, finish_reason = guided_message(body, answer)
    return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": None}


async def stream_guided(body: ChatCompletionRequest, envelope: Callable[[list[dict[str, Any]]], dict[str, Any]],
                        answers_soon: Awaitable[list[GuidedAnswer]], prompt_tokens: int) -> AsyncIterator[str]:
    """Roles first, then (once written) each whole answer in one chunk, its finish reason, usage, [DONE]."""
    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return sse(envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]))

    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    try:
        answers = await answers_soon
    except APIError as exc:
        yield sse_error(exc)
        return
    for index, answer in enumerate(answers):
        message, finish_reason = guided_message(body, answer)
        if message.get("tool_calls"):
            yield chunk(index, {"tool_calls": [dict(call, index=k) for k, call in enumerate(message["tool_calls"])]})
        else:
            yield chunk(index, {"content": message["content"]})
        yield chunk(index, {}, finish_reason)
    if body.include_usage:
        yield sse(envelope([]) | {"usage": usage(prompt_tokens, sum(a.completion_tokens for a in answers))})
    yield DONE
