"""POST /generate: vLLM's older API. `{"prompt", "stream", ...SamplingParams fields}` -> `{"text": [...]}`.

Each text is the prompt followed by one choice's output. A stream sends the texts so far after every
step, as JSON objects each ended by a NUL byte, as that API did. `use_beam_search` runs beam search
(beam.py): `best_of` beams, the `n` best returned.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend.entrypoints.beam_search import BeamSearchParams
from paged_backend.integrations.options.vocabularies import SAMPLING_PARAMS

from .beam import beam_search
from .errors import APIError, bad_request
from .fanout import Job, collect_finals, merge_streams, new_id, until_disconnect
from .protocol import GenerateRequest
from .sampling import build_params, check_prompt
from .state import ServerState

BEAM_FIELDS = frozenset({"n", "best_of", "max_tokens", "length_penalty", "early_stopping", "ignore_eos", "temperature"})


async def generate(state: ServerState, body: GenerateRequest, http_request: Request):
    fields = dict(body.model_extra or {})
    lora = state.check_model(body.model) if body.model is not None else None
    if body.use_beam_search:
        return await generate_beams(state, body, fields, http_request, lora)
    unknown = SAMPLING_PARAMS.unknown(fields)
    if unknown:
        raise bad_request(f"unknown sampling parameters: {unknown}", unknown[0])
    n = fields.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise bad_request(f"n must be an int in [1, 64], got {n!r}", "n")
    params = build_params(SAMPLING_PARAMS, fields, n=n)
    state.check_sequences(1, params.num_samples, "best_of" if params.best_of else "n")
    if body.stream and params.num_samples > n:
        raise bad_request("best_of > n cannot be streamed: the best samples are known only at the end", "best_of")
    text, ids = state.tokenize(body.prompt)
    check_prompt(state.client, ids, params)
    prompt_text = text if text is not None else state.tokenizer.decode(ids)
    jobs = [Job(0, ids, params, lora=lora)]
    request_id = new_id("generate")
    if body.stream:
        return StreamingResponse(stream_texts(state, jobs, prompt_text, request_id), media_type="application/json")
    finals = await collect_finals(http_request, state.client, jobs, request_id, state.metrics)
    return JSONResponse({"text": [prompt_text + finals[i].outputs[0].text for i in range(n)]})


async def stream_texts(state: ServerState, jobs: list[Job], prompt_text: str, request_id: str) -> AsyncIterator[bytes]:
    texts = [prompt_text] * sum(len(job.choices) for job in jobs)
    async for index, output in merge_streams(state.client, jobs, request_id, state.metrics):
        if output.error:
            yield (json.dumps(APIError(500, f"generation failed: {output.error}").body()) + "\0").encode()
            return
        texts[index] += output.delta_text  # deltas never hold half a character or a partial stop string
        yield (json.dumps({"text": texts}, ensure_ascii=False) + "\0").encode()


async def generate_beams(state: ServerState, body: GenerateRequest, fields: dict[str, Any], http_request: Request,
                         lora: str | None = None):
    """vLLM's older beam search: `best_of` beams (`n` when unset), the `n` best returned, greedy only."""
    if body.stream:
        raise bad_request("beam search cannot be streamed: the best beams are known only at the end", "stream")
    unknown = sorted(set(fields) - BEAM_FIELDS)
    if unknown:
        raise bad_request(f"beam search takes only {sorted(BEAM_FIELDS)}; got {unknown}", unknown[0])
    n, params = beam_params(fields)
    state.check_sequences(1, params.beam_width, "best_of")
    text, ids = state.tokenize(body.prompt)
    check_prompt(state.client, ids, build_params(SAMPLING_PARAMS, {"max_tokens": params.max_tokens}))
    search = beam_search(state.client, ids, params, state.client.eos_token_ids, new_id("generate"), state.metrics, lora)
    output = await until_disconnect(http_request, search)
    prompt_text = text if text is not None else state.tokenizer.decode(ids)
    return JSONResponse({"text": [prompt_text + state.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
                                  for seq in output.sequences[:n]]})


def beam_params(fields: dict[str, Any]) -> tuple[int, BeamSearchParams]:
    """(n, the search's parameters) from the body's fields, each checked with its name."""
    n, width = fields.get("n", 1), fields.get("best_of")
    width = n if width is None else width
    for name, value in (("n", n), ("best_of", width), ("max_tokens", fields.get("max_tokens", 16))):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value:
            raise bad_request(f"{name} must be an int >= 1, got {value!r}", name)
    if n > width:
        raise bad_request(f"n ({n}) cannot exceed the beam width best_of ({width})", "n")
    if fields.get("temperature", 0) != 0:
        raise bad_request("beam search is deterministic: temperature must be 0", "temperature")
    length_penalty = fields.get("length_penalty", 1.0)
    if not isinstance(length_penalty, int | float) or isinstance(length_penalty, bool):
        raise bad_request(f"length_penalty must be a number, got {length_penalty!r}", "length_penalty")
    ignore_eos = fields.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request(f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    try:
        return n, BeamSearchParams(beam_width=width, max_tokens=fields.get("max_tokens", 16),
                                   length_penalty=float(length_penalty),
                                   early_stopping=fields.get("early_stopping", False), ignore_eos=ignore_eos)
    except ValueError as exc:  # early_stopping, named in the message
        raise bad_request(str(exc), "early_stopping") from None


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate", dependencies=state.authorised())
    async def legacy_generate(body: GenerateRequest, request: Request):
        return await generate(state, body, request)
