"""Layer groups over one pool, with no model: how layers are grouped, window groups freeing the blocks
that fell out of their window, per-group prefix-cache hits, trimming, freeing and the context a lone
request can reach."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_backend.core.kv_cache_groups import UNBOUNDED_TOKENS, one_group, plan_groups
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.layer_specs import FullAttentionSpec, LayerSpec, SlidingWindowSpec
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.sampling.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 8


def specs(*windows: int | None) -> list[LayerSpec]:
    """A layer per window: full attention for None, else a sliding window of that many keys."""
    return [FullAttentionSpec() if window is None else SlidingWindowSpec(window) for window in windows]


# One full layer, one with an 8-key window: group 0 full, group 1 the window.
TWO_KINDS = plan_groups(specs(None, WINDOW))


def make_request(prompt: list[int]) -> Request:
    return Request("r", None, list(prompt), SamplingParams(max_tokens=4), 4, frozenset(), RequestMetrics(0.0))


def step(kv: KVCacheManager, request: Request, n: int) -> None:
    """Schedule and 'compute' `n` more tokens of the request, as the scheduler and update would."""
    assert kv.allocate_slots(request, n)
    request.num_computed_tokens += n
    kv.cache_full_blocks(request)


def held(kv: KVCacheManager, request: Request, group: int) -> list[int]:
    return [b for b in request.block_tables[group] if b != kv.null_block]


def test_layers_group_by_window_in_groups_of_the_rarest_kind():
    gemma3 = plan_groups(specs(32, 32, 32, 32, 32, None) * 2)
    assert gemma3.group_size == 2 and gemma3.num_groups == 6
    assert [g.spec for g in gemma3.groups] == [FullAttentionSpec()] + [SlidingWindowSpec(32)] * 5
    assert gemma3.groups[0].layers == (5, 11) and gemma3.groups[1].layers == (0, 1)
    assert gemma3.layer_group[11] == 0 and gemma3.layer_position[11] == 1
    assert gemma3.pages_for(10) == 60  # pages of 2 layers with the memory of 10 blocks of 12
    uneven = plan_groups(specs(4, 4, 4, None, None))  # three window layers in groups of two: one position unused
    assert [g.layers for g in uneven.groups] == [(3, 4), (0, 1), (2,)]
    mistral = plan_groups(specs(4, 4, 4))
    assert mistral.num_groups == 1 and mistral.group_size == 3 and mistral.frees_blocks
    assert plan_groups(specs(None, None)) == one_group(2) and not one_group(2).frees_blocks


def test_a_window_group_reads_from_the_block_of_its_first_key():
    spec = TWO_KINDS.groups[1].spec
    assert [spec.first_needed_block(p, BLOCK) for p in (0, 7, 8, 11, 12, 100)] == [0, 0, 0, 1, 1, 23]
    assert TWO_KINDS.groups[0].spec.first_needed_block(100, BLOCK) == 0


def test_a_window_group_frees_the_blocks_behind_its_window_as_the_request_grows():
    kv = KVCacheManager(64, BLOCK, groups=TWO_KINDS)
    request = make_request(list(range(40)))
    step(kv, request, 20)  # positions 0..19: every block written this step is still held
    assert len(held(kv, request, 0)) == 5 and len(held(kv, request, 1)) == 5
    step(kv, request, 1)  # the query at 20 reads keys 13..20: blocks 3..5
    assert len(held(kv, request, 0)) == 6
    assert request.block_tables[1][:3] == [kv.null_block] * 3 and len(held(kv, request, 1)) == 3
    for _ in range(19):
        step(kv, request, 1)
    assert len(held(kv, request, 0)) == 10 and len(held(kv, request, 1)) <= -(-(WINDOW - 1) // BLOCK) + 1
    assert kv.blocks_per_group() == [10, len(held(kv, request, 1))]
    assert kv.pool.num_free == 64 - 10 - len(held(kv, request, 1))
    kv.free(request)
    assert kv.pool.num_free == 64 and kv.blocks_per_group() == [0, 0]
    assert all(count == 0 for count in kv.pool.ref_counts)


def test_freed_window_blocks_stay_cached_until_reused():
    kv = KVCacheManager(64, BLOCK, groups=TWO_KINDS)
    first = make_request(list(range(30)))
    step(kv, first, 29)
    step(kv, first, 1)  # frees window blocks 0..4 (the query at 29 reads 22..29)
    kv.free(first)
    again = make_request(list(range(30)))
    assert kv.acquire_cached_prefix(again) == 28  # 7 full blocks; the last token is computed
    # The full group takes every block, the window group only those a query at 28 reads (21..27).
    assert len(again.block_tables[0]) == 7 and again.block_tables[1][:5] == [kv.null_block] * 5
    assert len(held(kv, again, 1)) == 2


def test_a_prefix_hit_ends_where_a_window_group_lost_a_block_of_its_window():
    kv = KVCacheManager(64, BLOCK, groups=TWO_KINDS)
    first = make_request(list(range(30)))
    step(kv, first, 29)
    window_blocks = list(first.block_tables[1])
    kv.free(first)
    lost = window_blocks[5]  # block 5 (positions 20..23) of the window group leaves the cache
    kv.pool.evict(lost)
    again = make_request(list(range(30)))
    # A hit of 7 blocks needs window blocks 5 and 6, of 6 blocks blocks 4 and 5: both lost. Of 5 blocks
    # (position 20), blocks 3 and 4 are read, and cached.
    assert kv.acquire_cached_prefix(again) == 20
    assert len(again.block_tables[0]) == 5 and held(kv, again, 1) == window_blocks[3:5]
    step(kv, again, 10)
    assert again.num_computed_tokens == 30


def test_a_window_only_model_hits_where_its_window_is_cached_without_the_blocks_before():
    kv = KVCacheManager(64, BLOCK, groups=plan_groups(specs(WINDOW, WINDOW)))
    first = make_request(list(range(30)))
    step(kv, first, 29)
    tables = list(first.block_tables[0])
    kv.free(first)
    kv.pool.evict(tables[0])  # long behind the window of any hit worth having
    again = make_request(list(range(30)))
    assert kv.acquire_cached_prefix(again) == 28
    assert again.block_tables[0][:5] == [kv.null_block] * 5 and held(kv, again, 0) == tables[5:7]


def test_trim_drops_rejected_tail_blocks_of_every_group():
    kv = KVCacheManager(64, BLOCK, groups=TWO_KINDS)
    request = make_request(list(range(20)))
    step(kv, request, 20)
    assert kv.allocate_slots(request, 9)  # proposals up to position 28: blocks 5..7
    kv.trim(request, 21)  # one accepted: block 5 kept
    assert [len(t) for t in request.block_tables] == [6, 6]
    kv.free(request)
    assert kv.pool.num_free == 64


def test_a_lone_request_fits_up_to_what_its_full_groups_hold():
    # Window group: at most ceil((8 - 1 + 4) / 4) + 1 = 4 blocks with steps of 4 tokens; the rest is the full group's.
    kv = KVCacheManager(20, BLOCK, groups=TWO_KINDS, max_step_tokens=4)
    assert kv.capacity_tokens == (20 - 4) * BLOCK
    assert KVCacheManager(20, BLOCK, groups=plan_groups(specs(WINDOW)), max_step_tokens=4).capacity_tokens == UNBOUNDED_TOKENS
    assert KVCacheManager(20, BLOCK).capacity_tokens == 20 * BLOCK  # one group keeping every block, as before


def test_a_lone_request_at_capacity_runs_to_its_end_without_running_out():
    kv = KVCacheManager(20, BLOCK, groups=TWO_KINDS, max_step_tokens=4)
    request = make_request(list(range(kv.capacity_tokens)))
    while request.num_computed_tokens < request.num_tokens:
        step(kv, request, min(4, request.num_tokens - request.num_computed_tokens))
    assert kv.pool.num_free >= 0


# (request slot, what it does, a size): start/grow by `size` tokens, trim to the kept tokens, finish, preempt.
ACTION = st.tuples(st.integers(0, 3), st.sampled_from(["grow", "trim", "finish", "preempt"]), st.integers(1, 12))


@settings(max_examples=40, deadline=None)
@given(actions=st.lists(ACTION, min_size=1, max_size=40), num_blocks=st.integers(6, 30),
       prompts=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_window_groups_never_leak_or_keep_a_block_behind_the_window(actions, num_blocks, prompts):
    """Any interleaving of growing (with shared prompts: prefix hits), trimming, finishing and preempting
    requests: every held block is counted once per holder, the free queue holds exactly the unreferenced
    blocks, each group's count is right, and after each allocation a window group holds nothing behind
    its window."""
    kv = KVCacheManager(num_blocks, BLOCK, groups=TWO_KINDS, max_step_tokens=12)
    requests: dict[int, Request] = {}
    for slot, what, size in actions:
        request = requests.get(slot)
        if what == "grow":
            if request is None:
                request = requests[slot] = make_request([prompts[slot]] * 40)
                kv.acquire_cached_prefix(request)
            n = min(size, request.num_tokens - request.num_computed_tokens)
            if n and kv.allocate_slots(request, n):
                first = TWO_KINDS.groups[1].spec.first_needed_block(request.num_computed_tokens, BLOCK)
                assert all(b == kv.null_block for b in request.block_tables[1][:first])
                request.num_computed_tokens += n
                kv.cache_full_blocks(request)
        elif request is not None and what == "trim":
            kv.trim(request, request.num_computed_tokens)
        elif request is not None:  # finish or preempt: either way its blocks go back
            kv.free(request)
            del requests[slot]
        check_pool(kv, requests.values())
    for request in requests.values():
        kv.free(request)
    assert kv.pool.num_free == num_blocks and kv.blocks_per_group() == [0, 0]


def check_pool(kv: KVCacheManager, requests) -> None:
    holders = Counter(b for r in requests for table in r.block_tables for b in table if b != kv.null_block)
    pool = kv.pool
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == holders.get(block, 0)
        assert (block in pool.free_queue) == (holders.get(block, 0) == 0)
    used = Counter(pool.block_group[b] for b in holders)
    assert kv.blocks_per_group() == [used.get(0, 0), used.get(1, 0)]
