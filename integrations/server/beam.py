"""Beam search for `/generate` on the server's shared engine.

`LLM.beam_search` steps an engine of its own; here the engine also serves every other client, so
each step goes through the client's `generate` like any request: every live beam asks for its top-K
next tokens (a one-token greedy request with K logprobs; a prompt's beams share its cached blocks).
The ranking, pruning and stopping are the offline search's own step (`paged_backend.entrypoints.beam_search
.advance`), so both return the same sequences.
"""

from __future__ import annotations

import asyncio

from paged_backend.core.outputs import RequestOutput
from paged_backend.entrypoints.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    PromptBeams,
    advance,
    finalise,
)
from paged_backend.entrypoints.engine_client import EngineClient
from paged_backend.sampling.sampling_params import SamplingParams

from .errors import APIError
from .metrics import ServerMetrics


async def beam_search(client: EngineClient, prompt_ids: list[int], params: BeamSearchParams,
                      eos_token_ids: frozenset[int], request_id: str, metrics: ServerMetrics,
                      lora: str | None = None) -> BeamSearchOutput:
    state = PromptBeams(prompt_ids, [([], 0.0)])
    eos = frozenset() if params.ignore_eos else frozenset(params.eos_token_ids or eos_token_ids)
    k = max(2, 1 + len(eos)) * params.beam_width  # enough candidates to refill every beam past the EOS ones
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
    for step in range(params.max_tokens):
        if state.done:
            break
        tops = await asyncio.gather(*(
            next_tokens(client, prompt_ids + tokens, step_params, k, f"{request_id}-{step}-{i}", metrics, lora)
            for i, (tokens, _) in enumerate(state.running)))
        advance(state, list(tops), step + 1, eos, params)
    return finalise(state, params)


async def next_tokens(client: EngineClient, ids: list[int], params: SamplingParams, k: int, request_id: str,
                      metrics: ServerMetrics, lora: str | None = None) -> list[tuple[int, float]]:
    """The k most likely next tokens of one beam with their log-probabilities, best first."""
    final: RequestOutput | None = None
    async for final in client.generate(ids, params, request_id=request_id, lora=lora):
        pass
    metrics.record_finished(final)
    if final.error:
        raise APIError(500, f"generation failed: {final.error}")
    entry = final.outputs[0].logprobs[0]
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in entry.items() if lp.rank is not None)
    return [(token, logprob) for _, token, logprob in ranked[:k]]
