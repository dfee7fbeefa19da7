"""POST /generate: vLLM's older API. `{"prompt", "stream", ...SamplingParams fields}` -> `{"text": [...]}`.

Each text is the prompt followed by one choice's output. A stream sends the texts so far after every
step, as JSON objects each ended by a NUL byte, as that API did.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend import SamplingParams

from .errors import APIError, bad_request, not_supported
from .fanout import Job, collect_finals, merge_streams, new_id
from .protocol import GenerateRequest
from .sampling import build_params, check_prompt
from .state import ServerState

PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


async def generate(state: ServerState, body: GenerateRequest, http_request: Request):
    if body.use_beam_search:
        raise not_supported("use_beam_search", "beam search runs offline through LLM.beam_search, which steps "
                            "the engine itself; this server's engine is shared by concurrent requests")
    fields = dict(body.model_extra or {})
    unknown = sorted(set(fields) - PARAM_FIELDS)
    if unknown:
        raise bad_request(f"unknown sampling parameters: {unknown}", unknown[0])
    n = fields.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise bad_request(f"n must be an int in [1, 64], got {n!r}", "n")
    params = build_params(n=n, **fields)
    state.check_sequences(1, params.num_samples, "best_of" if params.best_of else "n")
    if body.stream and params.num_samples > n:
        raise bad_request("best_of > n cannot be streamed: the best samples are known only at the end", "best_of")
    text, ids = state.tokenize(body.prompt)
    check_prompt(state.engine, ids, params)
    prompt_text = text if text is not None else state.tokenizer.decode(ids)
    jobs = [Job(0, ids, params)]
    request_id = new_id("generate")
    if body.stream:
        return StreamingResponse(stream_texts(state, jobs, prompt_text, request_id), media_type="application/json")
    finals = await collect_finals(http_request, state.aengine, jobs, request_id, state.metrics)
    return JSONResponse({"text": [prompt_text + finals[i].outputs[0].text for i in range(n)]})


async def stream_texts(state: ServerState, jobs: list[Job], prompt_text: str, request_id: str) -> AsyncIterator[bytes]:
    texts = [prompt_text] * sum(len(job.choices) for job in jobs)
    async for index, output in merge_streams(state.aengine, jobs, request_id, state.metrics):
        if output.error:
            yield (json.dumps(APIError(500, f"generation failed: {output.error}").body()) + "\0").encode()
            return
        texts[index] += output.delta_text  # deltas never hold half a character or a partial stop string
        yield (json.dumps({"text": texts}, ensure_ascii=False) + "\0").encode()
