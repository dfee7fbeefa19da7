"""What a request returns: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from paged_backend.tracing import Timeline


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    reasoning: str | None = None  # a reasoning model's thinking, split off `text` by LLM.chat's reasoning parser

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    timeline: Timeline | None = field(default=None, repr=False)  # when traced: what it went through (tracing.py)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request was refused or failed; the others keep running
    # With SamplingParams.prompt_logprobs: None, then {token id: Logprob} for each later prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Text produced since the previous output of this request (for streaming). With n > 1 a streamed
    # output holds only the sample that changed, so the delta is that sample's; the last output holds
    # every sample and no delta.
    delta_text: str = field(default="", repr=False)
    delta_token_ids: list[int] = field(default_factory=list, repr=False)
    # A pooling request's embedding (core/pooling.py): fp32 on the CPU, set on its finished output.
    embedding: torch.Tensor | None = field(default=None, repr=False)


def failed_output(request_id: str, prompt: str | None, prompt_token_ids: list[int], error: str | None,
                  last: RequestOutput | None = None) -> RequestOutput:
    """The finished output a request ends with when it is refused, fails or is aborted outside the
    engine's step (e.g. a duplicate id, a replica that died, a client's abort): `finish_reason="abort"`,
    `error` saying why (None for an abort the caller asked for). It keeps whatever the caller already
    received in `last`, with no new delta."""
    if last is not None:
        completion = replace(last.outputs[0], finish_reason="abort", stop_reason=None)
        return replace(last, outputs=[completion], finished=True, error=error, delta_text="", delta_token_ids=[])
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                         outputs=[CompletionOutput(0, "", [], finish_reason="abort")], finished=True,
                         metrics=RequestMetrics(arrival_time=time.time()), error=error)
