"""POST /v1/completions: text in, text out, for one prompt or many, n choices each, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend.core.outputs import RequestOutput

from ..logprobs import completion_logprobs, positions, token_text
from .errors import APIError, bad_request, request_field
from .fanout import Job, collect_finals, merge_streams, new_id
from .protocol import CompletionRequest
from .responses import DONE, sse, sse_error, usage
from .sampling import bias_processor, check_prompt, to_sampling_params, with_choices
from .state import ServerState
from .structured_request import structured_spec

Prompt = str | list[int]


async def create_completion(state: ServerState, body: CompletionRequest, http_request: Request):
    body.check_supported()
    lora = state.check_model(body.model)
    params = to_sampling_params(body, body.max_tokens, body.logprobs, structured_spec(body))
    if body.echo and body.logprobs is not None:  # the echoed prompt comes with its tokens' logprobs
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    texts = prompt_list(body.prompt)
    per_prompt = body.best_of or body.n
    state.check_sequences(len(texts), per_prompt, "prompt" if len(texts) > 1 else "best_of" if body.best_of else "n")
    with request_field("prompt"):
        prompts = [state.tokenize(text) for text in texts]
    prompts = [(text, check_prompt(state.client, ids, params)) for text, ids in prompts]
    bias = bias_processor(state.client, body.logit_bias)
    jobs = [Job(i * body.n, ids, with_choices(params, body.n, body.best_of), bias, lora)
            for i, (_, ids) in enumerate(prompts)]
    echoes = [echo_text(state, text, ids) if body.echo else "" for text, ids in prompts for _ in range(body.n)]
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    request_id = new_id("cmpl")
    if body.stream:
        events = stream_completion(state, body, jobs, echoes, prompt_tokens, request_id)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await collect_finals(http_request, state.client, jobs, request_id, state.metrics)
    choices = [completion_choice(state, body, i, finals[i], echoes[i]) for i in range(len(echoes))]
    completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals.values())
    return JSONResponse(envelope(request_id, body.model, choices) | {"usage": usage(prompt_tokens, completion_tokens)})


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


def echo_text(state: ServerState, text: str | None, ids: list[int]) -> str:
    if text is not None:
        return text
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


def envelope(request_id: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices}


def completion_choice(state: ServerState, body: CompletionRequest, index: int, output: RequestOutput,
                      echo: str) -> dict[str, Any]:
    completion = output.outputs[0]
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, positions(completion), body.logprobs, len(echo))
        if echo:
            logprobs = join_logprobs(echoed_logprobs(state, output, body.logprobs), logprobs)
    return {"index": index, "text": echo + completion.text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


async def stream_completion(state: ServerState, body: CompletionRequest, jobs: list[Job], echoes: list[str],
                            prompt_tokens: int, request_id: str) -> AsyncIterator[str]:
    generated = [0] * len(echoes)
    echo_pending = [bool(e) for e in echoes]
    offsets = [len(e) for e in echoes]  # each choice's next text_offset, counted as the plain answer counts
    async for index, output in merge_streams(state.client, jobs, request_id, state.metrics):
        if output.error:
            yield sse_error(APIError(500, f"generation failed: {output.error}"))
            return
        generated[index] = len(output.outputs[0].token_ids)
        echo = echoes[index] if echo_pending[index] else ""
        echo_pending[index] = False
        text = echo + output.delta_text
        if text or output.finished:
            choice = stream_choice(state, body, index, output, text, offsets[index])
            if choice["logprobs"] is not None:
                offsets[index] += sum(len(token) for token in choice["logprobs"]["tokens"])
                if echo:
                    choice["logprobs"] = join_logprobs(echoed_logprobs(state, output, body.logprobs),
                                                       choice["logprobs"])
            event = envelope(request_id, body.model, [choice])
            if body.continuous_usage:
                event["usage"] = usage(prompt_tokens, sum(generated))
            yield sse(event)
    if body.include_usage:
        yield sse(envelope(request_id, body.model, []) | {"usage": usage(prompt_tokens, sum(generated))})
    yield DONE


def echoed_logprobs(state: ServerState, output: RequestOutput, k: int) -> dict[str, list[Any]]:
    """The echoed prompt's part of the legacy logprobs: its first token has no context, so null."""
    ids, scored = output.prompt_token_ids, output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    part = completion_logprobs(state.tokenizer, list(zip(ids[1:], scored[1:])), k,
                               offset=len(token_text(state.tokenizer, ids[0])))
    return join_logprobs({"tokens": [token_text(state.tokenizer, ids[0])], "token_logprobs": [None],
                          "top_logprobs": [None], "text_offset": [0]}, part)


def join_logprobs(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + then[key] for key in first}


def stream_choice(state: ServerState, body: CompletionRequest, index: int, output: RequestOutput,
                  text: str, offset: int) -> dict[str, Any]:
    """One chunk's choice; its logprobs' text_offsets start at `offset`, where the previous chunk's ended."""
    completion = output.outputs[0]
    logprobs = None
    if body.logprobs is not None:
        pairs = positions(completion, len(output.delta_token_ids))
        logprobs = completion_logprobs(state.tokenizer, pairs, body.logprobs, offset)
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason if output.finished else None,
            "stop_reason": completion.stop_reason if output.finished else None}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", dependencies=state.authorised())
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)
