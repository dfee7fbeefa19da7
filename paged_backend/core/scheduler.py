"""Scheduler: decides which requests run in the next step and how many tokens each computes.

There is no prefill or decode phase. Every request has `num_computed_tokens`; each step gives
running requests (oldest first) the tokens they lack under one token budget, then admits waiting
requests in arrival order, slicing long prompts (chunked prefill). A request admitted for the
first time starts after its longest cached prefix. When blocks run out, the newest
running request is preempted: its blocks are freed and it is recomputed later from its tokens.
With LoRA, a waiting request whose adapter has no device slot free stays waiting, and others may pass
it, except onto the one slot chosen to drain for it (see `lora_blocks`): a stream of requests for
loaded adapters cannot keep it waiting for ever.

After the step the scheduler takes in its result (`update_from_output`): progress, tokens appended one at a
time with their stop checks and grammar, finished requests freed, speculative tails trimmed.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from paged_backend.core.image_span import chunk_end
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.step_result import RequestUpdate, StepResult

if TYPE_CHECKING:  # built by the engine and handed in; the scheduler only reads and calls them
    from paged_backend.config import EngineConfig
    from paged_backend.model.lora import LoRASlots
    from paged_backend.speculative.speculation import Speculator


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, speculator: Speculator | None = None,
                 lora: LoRASlots | None = None) -> None:
        self.max_tokens = config.max_num_batched_tokens
        self.lora = lora
        self.speculator = speculator
        self.max_seqs = config.max_num_seqs
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # The running request computing each prompt (by KVCacheManager.prompt_key), which its twins wait for.
        self.prompt_leaders: dict[int, Request] = {}
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefill, recompute and decode)
        self.utilisation_samples: list[float] = []  # per step: tokens stored / slots allocated

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        batch = SchedulerOutput([], [], [])
        preemptions_before = self.num_preemptions
        budget = self.schedule_running(batch, self.max_tokens)
        # After a preemption the cache is full: admitting new work would only preempt again.
        if self.num_preemptions == preemptions_before:
            self.schedule_waiting(batch, budget)
        if self.speculator is not None:
            self.add_proposals(batch)
        return batch

    def add_proposals(self, batch: SchedulerOutput) -> None:
        """Proposed tokens ride along with decoding requests in the room the step has left (the speculator's
        policy, within the token budget); they never preempt anything or push a request past max_tokens.
        N-gram proposals are made here; a draft model's are only counted here (their blocks allocated) and
        made for all of the step's requests at once (`Speculator.make_drafts`)."""
        scheduled = sum(batch.num_new_tokens)
        room = self.speculator.room(scheduled, self.max_tokens - scheduled)
        drafting = self.speculator.draft is not None
        for i, request in enumerate(batch.requests):
            if room <= 0:
                return
            if batch.num_new_tokens[i] != 1 or request.num_tokens - request.num_computed_tokens != 1:
                continue
            if request.grammar is not None:  # its matcher would have to follow every proposal: it decodes plainly
                continue
            # Keeping every proposal adds 1 + len(proposals) tokens: stay within max_tokens.
            limit = self.speculator.allowance(request, min(room, request.max_tokens - request.num_output_tokens - 1),
                                              scheduled)
            if limit <= 0:
                continue
            proposals = None if drafting else self.speculator.propose(request, limit)
            n = limit if drafting else len(proposals)
            if n and self.kv.allocate_slots(request, 1 + n):
                if drafting:
                    batch.drafts.append(i)
                else:
                    request.spec_token_ids = proposals
                batch.num_new_tokens[i] += n
                room -= n

    def schedule_running(self, batch: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self.chunk(request, budget)
            if n == 0:  # the rest of an image computed whole does not fit this step's budget
                i += 1
                continue
            while not self.kv.allocate_slots(request, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    return budget
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        return budget

    def schedule_waiting(self, batch: SchedulerOutput, budget: int) -> None:
        draining = 0  # the LoRA slot held back for a request that found none free (0: none so far this step)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_seqs:
            request = self.waiting[i]
            if request.group.waits_for_leader(request) or self.waits_for_twin(request):
                i += 1
                continue
            blocked, draining = self.lora_blocks(request, draining)
            if blocked:
                i += 1
                continue
            if not self.admit(request, budget):
                return
            del self.waiting[i]
            self.running.append(request)
            if request.prompt_key and request.num_computed_tokens < request.num_prompt_tokens:
                self.prompt_leaders[request.prompt_key] = request
            batch.requests.append(request)
            n = self.chunk(request, budget)
            batch.num_new_tokens.append(n)
            budget -= n

    def chunk(self, request: Request, budget: int) -> int:
        """The tokens the request runs this step: what it lacks, within the budget, its chunk of prefill not cutting
        an image whose tokens attend both ways (image_span.chunk_end; 0: it waits for a step with room)."""
        start = request.num_computed_tokens
        n = min(request.num_tokens - start, budget)
        return chunk_end(request.images, start, start + n) - start if request.images else n

    def waits_for_twin(self, request: Request) -> bool:
        """A new request whose very prompt a running request is computing (TRL's num_generations rows, a prompt
        sent twice at once) waits until that prompt is computed, then takes its blocks from the prefix cache
        instead of computing them again, as a group's samples wait for their leader."""
        if request.num_computed_tokens or request.metrics.num_preemptions:
            return False
        if request.prompt_key is None:
            request.prompt_key = self.kv.prompt_key(request) or 0  # 0: computed, nothing to share
        leader = self.prompt_leaders.get(request.prompt_key) if request.prompt_key else None
        return (leader is not None and leader is not request and leader.status is RequestStatus.RUNNING
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def lora_blocks(self, request: Request, draining: int) -> tuple[bool, int]:
        """Whether the request's adapter keeps it waiting this step, and the slot held back from now on.

        A request whose adapter is not loaded while every slot has running users cannot start. Left at
        that, later requests for the loaded adapters would keep those slots busy for ever (with one slot,
        a steady stream for adapter A starves a request for B). So the first such request picks one slot
        to drain, and requests behind it in line that would add a user to that slot wait too: the slot
        empties as its running requests finish (none is preempted for it) and the blocked request, first
        in line, loads into it. Only that slot is held: requests for the other loaded adapters and for the
        base model (which holds no slot) go ahead, so the rest of the batch keeps its throughput. No slot
        empties during one pass (admitting only adds users), so one choice per step suffices."""
        if self.lora is None or request.lora is None:
            return False, draining
        slot = self.lora.slot_of(request.lora)
        if slot is not None:
            return slot == draining, draining
        if self.lora.has_idle_slot():
            return False, draining
        return True, draining or self.lora.slot_to_drain()

    def admit(self, request: Request, budget: int) -> bool:
        """Take the request's cached prefix and blocks for its first chunk; False (nothing held) if full, or if the
        budget left has no room for the rest of an image it must compute whole."""
        if request.num_computed_tokens == 0 and request.pooling is None:  # pooling needs every position's hidden state
            hit = self.kv.acquire_cached_prefix(request)
            if request.metrics.first_scheduled_time is None:
                request.num_cached_tokens = hit
        n = self.chunk(request, budget)
        if n == 0 or not self.kv.allocate_slots(request, n):
            self.kv.free(request)
            request.num_computed_tokens = 0
            return False
        request.status = RequestStatus.RUNNING
        if self.lora is not None:
            request.lora_slot = self.lora.acquire(request.lora)
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.time()
        return True

    def preempt(self, request: Request) -> None:
        """Free the request's blocks and put it first in line; it will recompute its tokens, or with a second tier
        read its full blocks back (swap) where the offloader's preemption mode says so."""
        request.recompute = self.kv.offload is None or not self.kv.offload.swaps(request)
        self.running.remove(request)
        self.release(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        if request.metrics.timeline is not None:
            request.metrics.timeline.preemptions.append(time.time())
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str | None = None) -> None:
        """Remove a request wherever it is and free its blocks; `reason` (stop, length, abort) is recorded."""
        if reason is not None:
            request.finish_reason = reason
            request.metrics.finished_time = time.time()
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        if request.prompt_key and self.prompt_leaders.get(request.prompt_key) is request:
            del self.prompt_leaders[request.prompt_key]
        request.status = RequestStatus.FINISHED

    def release(self, request: Request) -> None:
        """A request that stops running gives back its use of its adapter's slot."""
        if self.lora is not None:
            self.lora.release(request.lora_slot)
            request.lora_slot = 0

    # ---------------------------------------------------------------- after the step

    def update_from_output(self, batch: SchedulerOutput, result: StepResult) -> list[RequestUpdate]:
        """Take in one step's result: progress, then each sampling request's kept tokens appended one by one,
        as if each came from its own step (a stop may end it before its last kept token), then the pooling
        requests whose whole prompt is computed finished. Finished requests leave and free their blocks; with
        speculation the others keep only the blocks their tokens fill. One update per changed request."""
        self.advance(batch, result)
        now = time.time()
        updates = [self.append_tokens(request, tokens, row, now)
                   for request, tokens, row in zip(result.sampling_requests, result.kept, result.rows)]
        updates += self.finish_pooled(result.pooled)
        if self.speculator is not None:
            for request in result.sampling_requests:
                if not request.is_finished:  # the next step allocates the room its own proposals need
                    self.kv.trim(request, request.num_tokens)
        return updates

    def advance(self, batch: SchedulerOutput, result: StepResult) -> None:
        """Each request's progress by the tokens it computed (of its proposals, only the kept ones: the K/V of
        the others is overwritten later) and its full blocks registered in the prefix cache; the draft's
        progress follows the target's."""
        kept_of = dict(zip(result.sampling_requests, result.kept)) if self.speculator else None
        for request, n in zip(batch.requests, batch.num_new_tokens):
            if request.spec_token_ids:  # progress counts the last token and the kept proposals only
                n -= len(request.spec_token_ids) - (len(kept_of[request]) - 1)
                request.spec_token_ids = []
            request.num_computed_tokens += n
            if request.pooling is None:  # a pooling request leaves no KV behind
                self.kv.cache_full_blocks(request)
        if batch.drafts:
            self.speculator.draft.settle()
        self.num_computed_tokens += sum(batch.num_new_tokens)
        self.record_utilisation()

    def append_tokens(self, request: Request, tokens: list[int], row: int, now: float) -> RequestUpdate:
        """Append the request's kept tokens until one ends it; the update says what it appended."""
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        appended = []
        for token in tokens:
            request.output_token_ids.append(token)
            appended.append(token)
            self.check_stop(request, token)
            if request.grammar is not None and not request.is_finished:
                self.advance_grammar(request, token)
            if request.is_finished:
                break
        return RequestUpdate(request, appended, row, request.group.finished)

    def check_stop(self, request: Request, token: int) -> None:
        """End the request at a stop string (its incremental detokenizer finds them), a stop token (eos, or
        one of the caller's, once min_tokens are out) or max_tokens."""
        stop_string = request.detokenizer.update([token]) if request.detokenizer else None
        if stop_string is not None:
            request.stop_reason = stop_string
            self.finish(request, "stop")
        elif token in request.stop_ids and request.num_output_tokens >= request.params.min_tokens:
            # A stop token of the caller's is the stop reason; eos (the other stop ids) is none.
            request.stop_reason = token if token in request.params.stop_token_ids else None
            self.finish(request, "stop")
        elif request.num_output_tokens >= request.max_tokens:
            self.finish(request, "length")

    def advance_grammar(self, request: Request, token: int) -> None:
        """Move the request's matcher past `token`; a completed grammar ends the request even when
        its stop token is not one the engine stops on (ignore_eos)."""
        if not request.grammar.accept(token):  # only when the mask left nothing to pick (e.g. min_tokens)
            request.error = f"token {token} does not fit the structured_outputs grammar"
            self.finish(request, "abort")
        elif request.grammar.is_terminated():
            self.finish(request, "stop")

    def finish_pooled(self, requests: list[Request]) -> list[RequestUpdate]:
        """Finish the pooling requests whose whole prompt is computed (their blocks freed; the output
        processor makes their embedding)."""
        updates = []
        for request in requests:
            if request.num_computed_tokens < request.num_tokens or request.is_finished:
                continue
            self.finish(request, "stop")
            updates.append(RequestUpdate(request, [], 0, request.group.finished))
        return updates

    def record_utilisation(self) -> None:
        """Tokens stored / slots allocated, counting a block shared by several requests once."""
        allocated = self.kv.slots_in_use()
        if not allocated:
            return
        bs = self.kv.block_size
        filled: dict[int, int] = {}
        for request in self.running:
            computed = request.num_computed_tokens
            for table in request.block_tables:
                for i, block_id in enumerate(table[: -(-computed // bs)]):
                    filled[block_id] = max(filled.get(block_id, 0), min(bs, computed - i * bs))
        filled.pop(self.kv.null_block, None)  # a window group's freed entries
        self.utilisation_samples.append(sum(filled.values()) / allocated)
