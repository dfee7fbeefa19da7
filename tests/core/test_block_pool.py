"""Property tests: whatever sequence of add / step / abort / finish, the block pool stays sound."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers.engine import assert_all_blocks_free
from helpers.models import build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_backend import Engine, EngineConfig, SamplingParams
from paged_backend.core.block_pool import BlockPool


def test_pool_allocate_free_roundtrip():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_counts[i] == 1 for i in ids)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.free(ids)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([ids[0]])


@pytest.fixture(scope="module")
def model():
    return build("llama")


SHARED = [1 + (7 * k) % 200 for k in range(30)]

action = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 40), st.just(0)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=1, max_size=25), num_blocks=st.integers(8, 24),
       budget=st.integers(4, 40))
def test_any_sequence_frees_every_block(model, actions, num_blocks, budget):
    engine = Engine(model, None, EngineConfig(num_kv_blocks=num_blocks, block_size=4,
                                              max_num_batched_tokens=budget, max_num_seqs=6))
    pool = engine.kv.pool
    ids: list[str] = []
    for kind, a, b in actions:
        if kind == "add":
            ids.append(engine.add_request(SHARED[:a],  # prompts share prefixes, so cached blocks are shared
                                          SamplingParams(temperature=0, max_tokens=b, ignore_eos=True)))
        elif kind == "step":
            for _ in range(a):
                engine.step()
        elif ids:
            engine.abort_request(ids[a % len(ids)])
        check_pool_invariants(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_pool_invariants(engine)
    assert_all_blocks_free(engine)
    assert len(set(pool.free_ids)) == pool.num_blocks


def check_pool_invariants(engine: Engine) -> None:
    """Every block's reference count is the number of requests holding it (shared prefixes count once
    per holder); a block is on the free list exactly when nobody holds it."""
    pool = engine.kv.pool
    assert all(c >= 0 for c in pool.ref_counts)
    holders = Counter(b for r in engine.scheduler.running + list(engine.scheduler.waiting) for b in r.block_ids)
    for request in engine.scheduler.running + list(engine.scheduler.waiting):
        assert len(set(request.block_ids)) == len(request.block_ids), "a request holds a block twice"
    free = pool.free_ids
    assert len(set(free)) == len(free), "a block is on the free list twice"
    assert not set(free) & set(holders), "a block in use is on the free list"
    assert len(free) + len(holders) == pool.num_blocks
    assert all(pool.ref_counts[b] == n for b, n in holders.items())
