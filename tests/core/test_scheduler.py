"""Scheduler alone, with a small KV manager and no model: who runs, who is preempted, where it waits."""

from __future__ import annotations

from paged_backend.config import EngineConfig
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.core.scheduler import Scheduler
from paged_backend.sampling.sampling_params import SamplingParams

BLOCK = 4


def make_request(name: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(name, None, list(range(1, prompt_len + 1)), params, max_tokens, frozenset(), RequestMetrics(0.0))


def make_scheduler(num_blocks: int, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False))


def step(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """One engine step without a model: advance every scheduled request, give each that reached the end
    of its tokens one new token, finish those at max_tokens. Returns (scheduled, finished) names."""
    batch = scheduler.schedule()
    finished = []
    for request, n in zip(batch.requests, batch.num_new_tokens):
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(7)
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request)
                finished.append(request.request_id)
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
