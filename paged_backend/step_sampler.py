"""StepSampler: a step's logits made into its StepResult.

The first logits rows are those of the requests that sample (1 + its proposals for a request carrying proposed
tokens), then those scoring prompt tokens. A step without proposals samples one row per request. With proposals,
each verified position is a row; the speculator keeps each request's tokens up to the first that differs from its
proposal, and a seeded generator is rewound to where it would be had it drawn for the kept tokens only. Prompt
logprobs are recorded on their requests from the rows after the sampled ones.
"""

from __future__ import annotations

import torch

from paged_backend.core.request import Request
from paged_backend.core.step_result import StepResult
from paged_backend.model.step_inputs import StepInputs
from paged_backend.sampling import prompt_logprobs
from paged_backend.sampling.grammar_queue import GrammarQueue
from paged_backend.sampling.sampler import SamplerOutput, sample
from paged_backend.speculative.speculation import Speculator


class StepSampler:
    def __init__(self, grammar_queue: GrammarQueue, speculator: Speculator | None = None) -> None:
        self.grammar_queue = grammar_queue  # the bitmask of each constrained request's allowed tokens
        self.speculator = speculator

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> StepResult:
        """The step's result from its logits (the runner's rows for `inputs`); the caller holds inference mode."""
        requests = inputs.sampling_requests
        if self.speculator is None or not any(r.spec_token_ids for r in requests):
            sampled = sample(logits[: len(requests)], requests, self.grammar_queue.fill_bitmask(requests))
            kept, rows = [[token] for token in sampled.token_ids], list(range(len(requests)))
        else:
            sampled, kept, rows = self.verify(logits, requests)
        prompt_logprobs.record(logits[len(sampled.token_ids):], inputs.prompt_spans)
        pooled = inputs.pooling.requests if inputs.pooling is not None else []
        return StepResult(sampled, requests, kept, rows, pooled)

    def verify(self, logits: torch.Tensor, requests: list[Request]
               ) -> tuple[SamplerOutput, list[list[int]], list[int]]:
        """Sample a row per verified position; per request, the tokens it keeps and the row of its first."""
        # Constrained requests carry no proposals (see Scheduler.add_proposals): one row each, as the mask has.
        row_requests, extras = Speculator.expand_rows(requests)
        states = [Speculator.save_generator(r) for r in requests]
        sampled = sample(logits[: len(row_requests)], row_requests, self.grammar_queue.fill_bitmask(row_requests),
                         extras, Speculator.draft_rows(requests))
        kept, rows, row = [], [], 0
        for request, state in zip(requests, states):
            num_rows = len(request.spec_token_ids) + 1
            tokens = self.speculator.accept(request, sampled.token_ids[row : row + num_rows])
            if state is not None:
                Speculator.rewind_generator(request, state, len(tokens), logits.shape[-1])
            kept.append(tokens)
            rows.append(row)
            row += num_rows
        return sampled, kept, rows
