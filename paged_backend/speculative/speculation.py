"""Speculation: proposed tokens verified by the target model in the same step.

A decoding request computes one token per step. With speculation, the scheduler appends up to k
proposed tokens to it as extra query tokens (within the step's token budget and the per-step policy,
never past the request's max_tokens); the runner keeps the logits of all 1 + k positions, and the
sampler picks, at every position j, the token the request would get without speculation given the
proposals before j. The request keeps that token for the longest prefix where it equals the proposal,
plus the target's own token after it.

Proposals come from n-gram prompt lookup (ngram_proposer.py) or from a draft model
(draft_proposer.py), whose k batched forwards run just before the target's.

Why this is exact, for sampled requests too: every verified position is rejection sampling of a
proposal x drawn from q against the target's p: keep x with probability min(1, p(x)/q(x)), else draw
from max(p - q, 0) normalised; the emitted token is distributed as p. An n-gram proposal is
deterministic (q one-hot at x), where this reduces to "keep x exactly when the target's own sample y
equals x, else emit y" (accept with probability p(x); y drawn from p without x): that form needs no
q, and a seeded request's generator is rewound to one draw per emitted token, so it gets exactly the
tokens it would get without speculation. A draft model's sampled proposals carry their q rows into
the sampler (`DraftRows`); its greedy proposals are the greedy limit (keep x iff it is the argmax).

Progress advances only by what was kept: the K/V written for rejected proposals sits beyond the
request's computed tokens and is overwritten later, and blocks held only for them are freed at once.

Policy, per step and per request. A step of T tokens costs about a fixed part (reading the weights,
dispatch) plus T times a per-token part; `knee_tokens` is their ratio. A proposal adds one token's
work and, if kept, saves a request one step's share, so it pays when its chance of being kept is above
T / (T + knee): almost any proposal pays on one stream, only well-aimed ones in a large batch. Each
request keeps an estimate of that chance (a moving average of the share of its proposals kept) and
proposes only while the estimate clears the bar at the step's size before proposals; one barred
drifts back towards the prior, so text that starts copying later is tried again (a step so large that
even the prior is barred takes proposals only from requests that earned a higher estimate). Its proposal count
follows what it kept last time (`Speculator.adapt`), and one whose proposals are all rejected sits out
a growing number of steps. `max_step_tokens` is a hard cap on the size of a step taking proposals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_backend.core.request import Request
from paged_backend.sampling.race_noise import skip_rows
from paged_backend.sampling.sampler import DraftRows
from paged_backend.speculative.ngram_proposer import propose_ngram
from paged_backend.speculative.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from paged_backend.core.scheduler_output import SchedulerOutput
    from paged_backend.speculative.draft_proposer import DraftProposer

MAX_BACKOFF = 4  # a request whose proposals keep failing sits out at most 2**4 - 1 steps between tries
ACCEPTANCE_PRIOR = 0.6  # the share of proposals a request is expected to keep before it has proposed
ACCEPTANCE_WEIGHT = 0.3  # the weight of the latest verification in that moving average
RECOVERY = 1 / 16  # each barred step moves the estimate this share of the way back to the prior


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None) -> None:
        self.config = config
        self.draft = draft  # the draft model's proposer (method "draft_model"), else n-gram lookup
        self.num_drafts = 0  # request-steps that carried proposals
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ------------------------------------------------------------ proposing

    def room(self, step_tokens: int, budget_left: int) -> int:
        """How many proposed tokens this step may carry: the policy's cap on the step's size, within the
        token budget. A step already holding `max_step_tokens` is compute-bound and gets none."""
        return max(0, min(budget_left, self.config.max_step_tokens - step_tokens))

    def allowance(self, request: Request, limit: int, step_tokens: int) -> int:
        """How many proposals the request may carry in a step of `step_tokens` scheduled tokens (before any
        proposals, so every request meets the same bar): `limit`, k, and (per-request policy) what its
        recent verifications earned it; 0 while it sits out after proposals that were all rejected, or
        while its acceptance estimate is below the step's bar."""
        if not self.config.adapt_per_request:
            return min(limit, self.config.num_speculative_tokens)
        if request.spec_pause:
            request.spec_pause -= 1
            return 0
        estimate = acceptance_estimate(request)
        if estimate < self.bar(step_tokens):
            request.spec_acceptance = estimate + (ACCEPTANCE_PRIOR - estimate) * RECOVERY
            return 0
        return min(limit, request.spec_allowance or self.config.num_speculative_tokens)

    def bar(self, step_tokens: int) -> float:
        """The share of proposals a request must keep for proposing to pay in a step of this size."""
        return step_tokens / (step_tokens + self.config.knee_tokens)

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to `min(limit, k)` n-gram tokens to verify after the request's last token."""
        k = min(limit, self.config.num_speculative_tokens)
        if k < 1:
            return []
        tokens = np.array(request.prompt_token_ids + request.output_token_ids, dtype=np.int64)
        return propose_ngram(tokens, self.config.prompt_lookup_max, self.config.prompt_lookup_min, k)

    def make_drafts(self, batch: SchedulerOutput) -> None:
        """The draft model's proposals for the requests the scheduler counted them for, in batched forwards."""
        requests = [batch.requests[i] for i in batch.drafts]
        counts = [batch.num_new_tokens[i] - 1 for i in batch.drafts]
        for request, proposals in zip(requests, self.draft.propose(requests, counts)):
            request.spec_token_ids = proposals

    # ------------------------------------------------------------ verifying

    @staticmethod
    def expand_rows(requests: list[Request]) -> tuple[list[Request], list[list[int]]]:
        """One sampler row per verified position: request i's row j follows its first j proposals."""
        rows: list[Request] = []
        extras: list[list[int]] = []
        for request in requests:
            proposals = request.spec_token_ids
            for j in range(len(proposals) + 1):
                rows.append(request)
                extras.append(proposals[:j])
        return rows, extras

    @staticmethod
    def draft_rows(requests: list[Request]) -> DraftRows | None:
        """The rows verifying proposals a draft model sampled (with the distributions they came from)."""
        rows, tokens, probs, row = [], [], [], 0
        for request in requests:
            if request.draft_probs is not None:
                rows.extend(range(row, row + len(request.spec_token_ids)))
                tokens.extend(request.spec_token_ids)
                probs.append(request.draft_probs)
            row += len(request.spec_token_ids) + 1
        return DraftRows(rows, tokens, torch.cat(probs)) if rows else None

    def accept(self, request: Request, targets: list[int]) -> list[int]:
        """The tokens the request keeps: the target's tokens up to and including the first that differs
        from its proposal (all of them when every proposal agreed)."""
        proposals = request.spec_token_ids
        kept = 0
        while kept < len(proposals) and proposals[kept] == targets[kept]:
            kept += 1
        if proposals:
            self.num_drafts += 1
            self.num_draft_tokens += len(proposals)
            self.num_accepted_tokens += kept
            self.adapt(request, len(proposals), kept)
        return targets[: kept + 1]

    def adapt(self, request: Request, proposed: int, kept: int) -> None:
        """The per-request policy: a request whose proposals were all kept may propose one more next time
        (up to k); one with some rejected proposes one more than it kept; one with none kept proposes a
        single token, after sitting out 1, 3, 7, then 15 steps as such misses repeat. So proposals go to
        the requests that copy (input-grounded text), not to those whose guesses keep failing."""
        k = self.config.num_speculative_tokens
        estimate = acceptance_estimate(request)
        request.spec_acceptance = estimate + (kept / proposed - estimate) * ACCEPTANCE_WEIGHT
        if kept == proposed:
            request.spec_misses = 0
            request.spec_allowance = min(k, proposed + 1)
        elif kept:
            request.spec_misses = 0
            request.spec_allowance = kept + 1
        else:
            request.spec_misses = min(request.spec_misses + 1, MAX_BACKOFF)
            request.spec_allowance = 1
            request.spec_pause = 2 ** request.spec_misses - 1

    @staticmethod
    def save_generator(request: Request) -> torch.Tensor | None:
        """The state of a seeded sampled request's generator before a step with proposals."""
        if request.generator is None or not request.spec_token_ids or request.params.temperature == 0.0 \
                or request.draft_probs is not None:  # rejection sampling against q draws as it goes
            return None
        return request.generator.get_state()

    @staticmethod
    def rewind_generator(request: Request, state: torch.Tensor, num_kept: int, vocab: int) -> None:
        """Leave the generator as if it had drawn for the kept tokens only (one noise row of the vocabulary
        per sampled token, the sampler's draw), so the next step continues the stream it would have without
        speculation."""
        request.generator.set_state(state)
        skip_rows(request.generator, num_kept, vocab)

    # ------------------------------------------------------------ metrics

    def stats(self) -> dict[str, float]:
        return speculation_stats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)


def acceptance_estimate(request: Request) -> float:
    """The request's estimated share of proposals kept; the prior until it has had a verification."""
    return ACCEPTANCE_PRIOR if request.spec_acceptance is None else request.spec_acceptance


def speculation_stats(drafts: int, proposed: int, accepted: int) -> dict[str, float]:
    """Counters of speculation and the rates derived from them (zeros when nothing was proposed)."""
    return {
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": proposed,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        # Tokens a request gains per step that carried proposals: the accepted ones plus the target's own.
        "spec_mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
    }
