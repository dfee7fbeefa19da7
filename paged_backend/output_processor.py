"""OutputProcessor: what a step changed, made into the user's `RequestOutput`s.

Per updated request it records the sampled logprobs of its new tokens (and, for a best_of group, the score
its samples are ranked by), takes the new text its incremental detokenizer has made, and assembles the
outputs: a streamed delta per changed sample, one final output per group (for n > 1 every sample in index
order; for best_of the best n), a pooling request's embedding. Outputs made between steps (an abort) wait
here and come out of the next step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from paged_backend.core.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.core.pooling import embedding_of

if TYPE_CHECKING:
    from paged_backend.core.request import Request
    from paged_backend.core.request_group import RequestGroup
    from paged_backend.core.step_result import RequestUpdate
    from paged_backend.sampling.sampler import SamplerOutput


class OutputProcessor:
    def __init__(self) -> None:
        self.pending: list[RequestOutput] = []  # made between steps; the next step returns them first

    def take_pending(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    def add_final(self, group: RequestGroup) -> None:
        """The final output of a group that ended between steps (aborted): it comes out of the next step."""
        self.pending.append(make_output(group.samples[-1], group.samples, [], finished=group.finished))

    def process(self, updates: list[RequestUpdate], sampled: SamplerOutput) -> list[RequestOutput]:
        """The outputs of one step's updates, in their order: every change of a streamed request, and the
        final output of each group that finished."""
        for update in updates:
            if update.request.pooling is None:
                record_sampled(update, sampled)
        outputs = []
        for update in updates:
            if update.request.pooling is not None:
                outputs.append(pooled_output(update.request))
            elif update.request.stream or update.group_finished:
                outputs.extend(outputs_after(update))
        return outputs


def record_sampled(update: RequestUpdate, sampled: SamplerOutput) -> None:
    """The logprobs of the request's new tokens (sampler rows `update.row` onward), when it asked for them,
    else a best_of sample's score."""
    request = update.request
    for row in range(update.row, update.row + len(update.new_token_ids)):
        if request.logprobs is not None:
            record_logprobs(request, sampled, row)
        elif request.group.ranked:
            request.cumulative_logprob += sampled.logprobs[row]


def outputs_after(update: RequestUpdate) -> list[RequestOutput]:
    """The user-facing outputs after the request changed. For n > 1, every delta is attributable: an output
    carries either the one sample that changed (with its delta) or, last of all, every sample in index order
    (finished, no delta of its own)."""
    request, delta_ids, finished = update.request, update.new_token_ids, update.group_finished
    group = request.group
    if len(group.samples) == 1 or not finished:
        return [make_output(request, [request], delta_ids, finished)]
    final = make_output(request, group.samples, [], finished)
    if not request.stream:
        return [final]
    return [make_output(request, [request], delta_ids, finished=False), final]


def pooled_output(request: Request) -> RequestOutput:
    """A finished pooling request's output, with its embedding (the pooled state is let go)."""
    embedding = embedding_of(request)
    request.pooled = None
    return dataclasses.replace(make_output(request, [request], [], request.group.finished), embedding=embedding)


def make_output(request: Request, samples: list[Request], delta_ids: list[int], finished: bool) -> RequestOutput:
    detok = request.detokenizer
    delta = detok.take_delta(request.is_finished) if detok and (delta_ids or len(samples) == 1) else ""
    return RequestOutput(
        request_id=request.group.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=completions_of(samples),
        finished=finished,
        metrics=request.metrics,
        num_cached_tokens=request.group.leader.num_cached_tokens,
        prompt_logprobs=request.group.leader.prompt_logprobs,
        error=request.error,
        delta_text=delta,
        delta_token_ids=delta_ids,
    )


def completions_of(samples: list[Request]) -> list[CompletionOutput]:
    """The completions an output carries; a best_of group keeps its best samples, best first, indexed 0..n-1."""
    group = samples[0].group
    if not group.ranked or len(samples) == 1:
        return [completion_of(r) for r in samples]
    return [completion_of(r, index=i) for i, r in enumerate(group.selected())]


def completion_of(request: Request, index: int | None = None) -> CompletionOutput:
    return CompletionOutput(
        index=request.index if index is None else index,
        text=request.detokenizer.output_text if request.detokenizer else "",
        token_ids=list(request.output_token_ids),
        cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        logprobs=request.logprobs,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
    )


def record_logprobs(request: Request, sampled: SamplerOutput, row: int) -> None:
    token = sampled.token_ids[row]
    chosen = sampled.logprobs[row]
    entry = {token: Logprob(chosen)}
    k = request.params.logprobs or 0
    if k and sampled.top_ids is not None:
        for rank, (tid, lp) in enumerate(zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]), start=1):
            entry.setdefault(tid, Logprob(lp, rank))
            if tid == token:
                entry[tid].rank = rank
    request.logprobs.append(entry)
    request.cumulative_logprob += chosen
