"""Scheduler alone, with a small KV manager and no model: who runs, who is preempted, where it waits."""

from __future__ import annotations

import torch

from paged_backend.config import EngineConfig
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.core.request_group import RequestGroup
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.step_result import StepResult
from paged_backend.model.lora import LoRAAdapter, LoRASlots
from paged_backend.sampling.sampler import SamplerOutput
from paged_backend.sampling.sampling_params import SamplingParams

BLOCK = 4


def make_request(name: str, prompt_len: int, max_tokens: int, prompt: list[int] | None = None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(1, prompt_len + 1)) if prompt is None else prompt
    return Request(name, None, prompt, params, max_tokens, frozenset(), RequestMetrics(0.0))


def make_scheduler(num_blocks: int, budget: int = 64, max_seqs: int = 8, prefix_caching: bool = False) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching))


def scheduled(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One step (see `step`) as the (name, new tokens) of each request it scheduled, in batch order."""
    return step(scheduler, counts=True)[0]


def step(scheduler: Scheduler, counts: bool = False) -> tuple[list, list[str]]:
    """One engine step without a model: advance every scheduled request, give each that reached the end
    of its tokens one new token, finish those at max_tokens, register filled blocks in the prefix cache.
    Returns (scheduled, finished) names; with `counts`, scheduled as (name, new tokens) pairs."""
    batch = scheduler.schedule()
    finished = []
    for request, n in zip(batch.requests, batch.num_new_tokens):
        request.num_computed_tokens += n
        scheduler.kv.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(7)
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request)
                finished.append(request.request_id)
    if counts:
        return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)], finished
    return [r.request_id for r in batch.requests], finished


def test_the_newest_running_request_is_preempted_and_resumes_before_later_arrivals():
    # 6 blocks of 4 tokens: a and b (4-token prompts, 12 new tokens each) cannot both reach 16 tokens,
    # and with two sequences at most, the later arrival waits while they run.
    scheduler = make_scheduler(num_blocks=6, max_seqs=2)
    a, b, late = make_request("a", 4, 12), make_request("b", 4, 12), make_request("late", 4, 12)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    scheduler.add(late)
    while not scheduler.num_preemptions:
        scheduled = step(scheduler)[0]
        assert scheduled == (["a"] if scheduler.num_preemptions else ["a", "b"])
    assert [r.request_id for r in scheduler.running] == ["a"]  # b arrived after a, so b gave its blocks back
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.metrics.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["b", "late"]  # first in line, ahead of late
    order: list[str] = []
    while scheduler.has_unfinished():
        order += step(scheduler)[1]
    assert order == ["a", "b", "late"]
    assert scheduler.num_preemptions <= 2
    assert scheduler.kv.pool.num_free == 6


def test_finish_order_stays_first_come_first_served_with_bounded_preemptions():
    """Eight equal requests through a cache that holds two at full length: they finish in arrival
    order, and each is preempted at most a few times (a preempted request sent to the back of the queue
    would be overtaken, and preempted again, by later arrivals)."""
    scheduler = make_scheduler(num_blocks=8, budget=16, max_seqs=4)  # some requests are preempted twice
    names = [f"r{i}" for i in range(8)]
    requests = [make_request(name, 6, 10) for name in names]
    for request in requests:
        scheduler.add(request)
    order: list[str] = []
    steps = 0
    while scheduler.has_unfinished():
        order += step(scheduler)[1]
        steps += 1
        assert steps < 500
    assert order == names
    assert 0 < scheduler.num_preemptions <= 8
    assert scheduler.num_preemptions == sum(r.metrics.num_preemptions for r in requests)
    assert scheduler.kv.pool.num_free == 8


def test_a_preempted_request_finished_while_waiting_leaves_the_queue():
    """An abort can reach a request while it waits after a preemption: it must leave the queue too."""
    scheduler = make_scheduler(num_blocks=6, max_seqs=2)
    a, b = make_request("a", 4, 12), make_request("b", 4, 12)
    scheduler.add(a)
    scheduler.add(b)
    while not scheduler.num_preemptions:
        step(scheduler)
    assert list(scheduler.waiting) == [b]
    scheduler.finish(b)
    assert not scheduler.waiting and b.is_finished
    while scheduler.has_unfinished():
        step(scheduler)
    assert a.is_finished and scheduler.kv.pool.num_free == 6


def test_a_step_never_schedules_more_than_the_token_budget():
    scheduler = make_scheduler(num_blocks=64, budget=10)
    for name in "abcde":
        scheduler.add(make_request(name, 7, 3))
    while scheduler.has_unfinished():
        batch = scheduled(scheduler)
        total = sum(n for _, n in batch)
        assert total <= 10
        if scheduler.waiting:  # work was left over: the step used the whole budget
            assert total == 10


def test_decoding_requests_are_scheduled_before_waiting_prompts():
    scheduler = make_scheduler(num_blocks=64, budget=8)
    for name in "ab":
        scheduler.add(make_request(name, 3, 10))
    assert scheduled(scheduler) == [("a", 3), ("b", 3)]
    scheduler.add(make_request("long", 20, 10))
    # The decodes take their one token each first; the new prompt gets what is left of the budget.
    assert scheduled(scheduler) == [("a", 1), ("b", 1), ("long", 6)]
    assert scheduled(scheduler) == [("a", 1), ("b", 1), ("long", 6)]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_after_the_last():
    scheduler = make_scheduler(num_blocks=64, budget=8)
    long = make_request("long", 21, 2)
    scheduler.add(long)
    chunks = []
    while not long.output_token_ids:
        ((_, n),) = scheduled(scheduler)
        chunks.append(n)
        assert len(long.block_ids) == -(-long.num_computed_tokens // BLOCK)  # blocks grow with the chunks
    assert chunks == [8, 8, 5]
    assert scheduled(scheduler) == [("long", 1)]  # then it decodes


def test_a_later_prompt_takes_the_budget_a_finishing_chunk_leaves():
    scheduler = make_scheduler(num_blocks=64, budget=8)
    scheduler.add(make_request("long", 12, 2))
    scheduler.add(make_request("short", 6, 2))
    assert scheduled(scheduler) == [("long", 8)]
    assert scheduled(scheduler) == [("long", 4), ("short", 4)]
    assert scheduled(scheduler) == [("long", 1), ("short", 2)]


def test_out_of_blocks_the_newest_running_request_is_preempted_and_recomputes_from_the_start():
    scheduler = make_scheduler(num_blocks=9, budget=64)
    a, b, c = make_request("a", 8, 8), make_request("b", 4, 8), make_request("c", 4, 8)
    for request in (a, b, c):
        scheduler.add(request)
    scheduled(scheduler)  # a: 2 blocks, b: 1, c: 1 (prompts), each with its first output token
    while not scheduler.num_preemptions:
        batch = scheduled(scheduler)
    assert [name for name, _ in batch] == ["a", "b"]  # c, the newest, gave way; a and b went on
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.metrics.num_preemptions == 1
    assert list(scheduler.waiting) == [c] and scheduler.running == [a, b]
    assert scheduler.kv.pool.num_free == 9 - len(a.block_ids) - len(b.block_ids)  # c's blocks back in the pool
    made = c.num_tokens
    while c not in scheduler.running:
        batch = scheduled(scheduler)
    assert ("c", made) in batch  # recomputes its prompt and the tokens it had made, in one go


def test_a_first_admission_starts_after_the_longest_cached_prefix_and_computes_the_last_prompt_token():
    scheduler = make_scheduler(num_blocks=64, budget=64, prefix_caching=True)
    prompt = list(range(100, 112))  # three full blocks
    scheduler.add(make_request("first", 0, 1, prompt))
    assert scheduled(scheduler) == [("first", 12)]
    same = make_request("same", 0, 1, list(prompt))
    longer = make_request("longer", 0, 1, prompt + [7, 8])
    forked = make_request("forked", 0, 1, prompt[:6] + [0] * 6)  # shares the first block only
    for request in (same, longer, forked):
        scheduler.add(request)
    # The same prompt: two blocks from the cache, the third recomputed so its last token has logits.
    assert scheduled(scheduler) == [("same", 4), ("longer", 2), ("forked", 8)]
    assert [same.num_cached_tokens, longer.num_cached_tokens, forked.num_cached_tokens] == [8, 12, 4]


def test_a_preempted_request_readmitted_recomputes_instead_of_counting_a_new_prefix_hit():
    """`num_cached_tokens` reports the first admission's hit; a re-admission after preemption may take
    its own blocks back from the cache, but that is not a hit the user's prompt got."""
    scheduler = make_scheduler(num_blocks=6, max_seqs=2, prefix_caching=True)
    a, b = make_request("a", 4, 12), make_request("b", 5, 12, list(range(50, 55)))
    scheduler.add(a)
    scheduler.add(b)
    while not scheduler.num_preemptions:
        scheduled(scheduler)
    assert b.num_cached_tokens == 0
    while b not in scheduler.running:
        tokens = b.num_tokens
        batch = scheduled(scheduler)
    recomputed = dict(batch)["b"]
    assert 0 < recomputed < tokens and (tokens - recomputed) % BLOCK == 0  # its own full blocks came back
    assert b.num_cached_tokens == 0


def test_no_more_than_max_num_seqs_requests_run_at_once():
    scheduler = make_scheduler(num_blocks=64, budget=64, max_seqs=2)
    for name in "abcd":
        scheduler.add(make_request(name, 3, 2))
    assert scheduled(scheduler) == [("a", 3), ("b", 3)]  # budget for all four, room for two
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert scheduled(scheduler) == [("a", 1), ("b", 1)]  # a and b finish here
    assert scheduled(scheduler) == [("c", 3), ("d", 3)]


def test_a_later_sample_is_admitted_only_after_its_leader_computed_the_prompt_and_shares_its_blocks():
    scheduler = make_scheduler(num_blocks=64, budget=8, prefix_caching=True)
    group = RequestGroup("user", None)
    prompt = list(range(30, 43))  # 13 tokens: two chunks at budget 8
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    leader, follower = (Request(f"user#{i}", None, list(prompt), params, 4, frozenset(), RequestMetrics(0.0),
                                group=group) for i in range(2))
    scheduler.add(leader)
    scheduler.add(follower)
    assert scheduled(scheduler) == [("user#0", 8)]  # budget left, but the follower waits
    assert scheduled(scheduler) == [("user#0", 5)]
    assert scheduled(scheduler) == [("user#0", 1), ("user#1", 1)]  # three blocks shared, one token computed
    assert follower.num_cached_tokens == 12 and follower.block_ids[:3] == leader.block_ids[:3]


# ------------------------------------------------------------------------ LoRA slots


def lora_scheduler(max_loras: int) -> Scheduler:
    """A scheduler whose requests may name adapters, over `max_loras` slots of a one-linear model."""
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=16,
                          enable_lora=True, max_loras=max_loras)
    slots = LoRASlots(torch.nn.Sequential(torch.nn.Linear(4, 4)), max_loras, max_rank=2)
    return Scheduler(config, KVCacheManager(256, BLOCK), lora=slots)


ADAPTERS = {name: LoRAAdapter(name, i, {"0": (torch.ones(2, 4), torch.ones(4, 2), 1.0)})
            for i, name in enumerate("ABC", start=1)}


def add_lora_request(scheduler: Scheduler, name: str, adapter: str | None, max_tokens: int = 3) -> None:
    request = make_request(name, 4, max_tokens)
    request.lora = ADAPTERS[adapter] if adapter else None
    scheduler.add(request)


def test_a_stream_for_a_loaded_adapter_cannot_keep_another_waiting_for_its_slot():
    """One slot: requests for A keep arriving; B waits only until A's running requests finish, because
    the A requests that came after B wait behind it. Base requests are not held back."""
    scheduler = lora_scheduler(max_loras=1)
    add_lora_request(scheduler, "a0", "A")
    scheduled(scheduler)
    add_lora_request(scheduler, "b", "B")
    seen: list[list[str]] = []
    for t in range(1, 12):
        add_lora_request(scheduler, f"a{t}", "A")
        add_lora_request(scheduler, f"base{t}", None)
        names, _ = step(scheduler)
        seen.append(names)
        assert f"base{t}" in names, "a base request holds no slot: it never waits for one"
        if "b" in names:
            break
    assert "b" in seen[-1], "B never got the slot: the A requests behind it kept it busy"
    assert len(seen) <= 4  # a0 needs its 3 tokens, then the slot is B's
    assert not any(n.startswith("a") and n != "a0" for names in seen for n in names)
    assert scheduler.lora.loaded[1] is ADAPTERS["B"]


def test_only_the_slot_chosen_to_drain_is_held_back():
    """Two slots: A (two users) and C (one user). B picks C to drain (fewer users); new A requests still
    start while B waits, new C requests wait behind B, and B loads into C's slot once it is empty."""
    scheduler = lora_scheduler(max_loras=2)
    add_lora_request(scheduler, "a0", "A", max_tokens=8)
    add_lora_request(scheduler, "a1", "A", max_tokens=8)
    add_lora_request(scheduler, "c0", "C", max_tokens=3)
    scheduled(scheduler)
    add_lora_request(scheduler, "b", "B")
    add_lora_request(scheduler, "c1", "C")
    add_lora_request(scheduler, "a2", "A")
    names, _ = step(scheduler)
    assert "a2" in names and "b" not in names and "c1" not in names
    names, finished = step(scheduler)
    assert finished == ["c0"] and "b" not in names and "c1" not in names
    names, _ = step(scheduler)
    assert "b" in names and "c1" not in names  # C's slot went to B; C now waits for a slot in turn
    assert scheduler.lora.loaded[1:] == [ADAPTERS["A"], ADAPTERS["B"]]


# ---------------------------------------------------------------- taking in a step's result


def decode_to_the_end(scheduler: Scheduler, tokens: list[list[int]]):
    """Schedule one step and take in a result keeping `tokens[i]` for the i-th scheduled request."""
    batch = scheduler.schedule()
    sampled = SamplerOutput([t for kept in tokens for t in kept])
    rows = [sum(len(kept) for kept in tokens[:i]) for i in range(len(tokens))]
    return scheduler.update_from_output(batch, StepResult(sampled, batch.requests, tokens, rows, []))


def test_a_step_result_appends_stops_and_frees():
    scheduler = make_scheduler(num_blocks=8)
    short, long_ = make_request("short", 4, 1), make_request("long", 4, 3)
    for request in (short, long_):
        scheduler.add(request)
    updates = decode_to_the_end(scheduler, [[5], [6]])
    assert [(u.request.request_id, u.new_token_ids, u.row) for u in updates] == [("short", [5], 0), ("long", [6], 1)]
    assert short.is_finished and short.finish_reason == "length" and short.metrics.finished_time is not None
    assert not short.block_ids and scheduler.running == [long_]
    assert long_.num_computed_tokens == 4 and long_.metrics.first_token_time is not None
    assert scheduler.num_computed_tokens == 8 and len(scheduler.utilisation_samples) == 1


def test_kept_tokens_after_a_stop_are_not_appended():
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("a", 4, 10)
    request.stop_ids = frozenset({9})
    scheduler.add(request)
    scheduler.schedule()  # the prompt
    request.num_computed_tokens = 4
    updates = scheduler.update_from_output(SchedulerOutput([request], [0], []),
                                           StepResult(SamplerOutput([3, 9, 4]), [request], [[3, 9, 4]], [0], []))
    assert updates[0].new_token_ids == [3, 9] and request.output_token_ids == [3, 9]
    assert request.finish_reason == "stop" and request.stop_reason is None  # a stop id not of the caller's: eos


def test_a_group_is_finished_once_when_its_samples_end_in_one_step():
    """Both samples of an n = 2 group end in the same step: only the later one's update finishes the group,
    so the group's final output is made once."""
    scheduler = make_scheduler(num_blocks=8)
    group = RequestGroup("g")
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    # The second sample waits for the leader's prompt, so the leader runs a step ahead and one token longer.
    samples = [Request(f"g#{i}", None, [1, 2, 3, 4], params, max_tokens, frozenset(), RequestMetrics(0.0),
                       group=group) for i, max_tokens in enumerate((2, 1))]
    for sample in samples:
        scheduler.add(sample)
    assert [u.group_finished for u in decode_to_the_end(scheduler, [[5]])] == [False]
    updates = decode_to_the_end(scheduler, [[6], [7]])
    assert [u.request.request_id for u in updates] == ["g#0", "g#1"] and group.finished
    assert [u.group_finished for u in updates] == [False, True]
