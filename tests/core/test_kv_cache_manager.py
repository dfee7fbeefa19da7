"""KVCacheManager alone, over a small pool and no model: block tables, chain hashing, prefix lookup,
freeing order, trimming."""

from __future__ import annotations

from types import SimpleNamespace

from paged_backend.core.kv_cache_manager import KVCacheManager, hash_block
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.sampling.sampling_params import SamplingParams

BLOCK = 4


def make_request(prompt: list[int], salt: str | None = None, lora_id: int | None = None,
                 prompt_logprobs: bool = False) -> Request:
    params = SamplingParams(max_tokens=4)
    return Request("r", None, list(prompt), params, 4, frozenset(), RequestMetrics(0.0), cache_salt=salt,
                   lora=SimpleNamespace(id=lora_id) if lora_id is not None else None,
                   prompt_logprobs=[None] if prompt_logprobs else None)


def computed(kv: KVCacheManager, request: Request) -> Request:
    """Allocate and 'compute' the whole prompt, registering its full blocks as a step would."""
    assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return request


def test_the_block_table_grows_only_when_the_new_tokens_cross_a_block_boundary():
    kv = KVCacheManager(8, BLOCK)
    request = make_request(list(range(10)))
    assert kv.allocate_slots(request, 3) and len(request.block_ids) == 1
    request.num_computed_tokens = 3
    assert kv.allocate_slots(request, 1) and len(request.block_ids) == 1  # slot 3 of block 0
    request.num_computed_tokens = 4
    assert kv.allocate_slots(request, 5) and len(request.block_ids) == 3  # tokens 4..8: blocks 1 and 2
    assert len(set(request.block_ids)) == 3 and kv.pool.num_free == 5


def test_a_table_that_cannot_grow_takes_nothing():
    kv = KVCacheManager(2, BLOCK)
    request = make_request(list(range(12)))
    assert not kv.allocate_slots(request, 9)  # needs 3 blocks of 2
    assert request.block_ids == [] and kv.pool.num_free == 2


def test_the_same_tokens_under_the_same_salt_and_adapter_share_blocks():
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(9))  # two full blocks, then one token
    first = computed(kv, make_request(prompt, salt="s", lora_id=3))
    second = make_request(prompt, salt="s", lora_id=3)
    assert kv.acquire_cached_prefix(second) == 8
    assert second.block_ids == first.block_ids[:2] and second.block_hashes == first.block_hashes


def test_another_salt_or_adapter_shares_nothing():
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(9))
    computed(kv, make_request(prompt, salt="s", lora_id=3))
    for other in (make_request(prompt, salt="t", lora_id=3), make_request(prompt, salt=None, lora_id=3),
                  make_request(prompt, salt="s", lora_id=4), make_request(prompt, salt="s")):
        assert kv.acquire_cached_prefix(other) == 0 and other.block_ids == []


def test_a_block_is_shared_only_after_the_same_chain_of_parents():
    """The second block's tokens match, but after another first block: its K/V differ, no hit."""
    kv = KVCacheManager(16, BLOCK)
    computed(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    request = make_request([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.acquire_cached_prefix(request) == 0
    key = (None, (5, 6, 7, 8), None, None, None)
    parent = hash_block((None, (1, 2, 3, 4), None, None, None))
    assert hash_block(key) != hash_block((parent, (5, 6, 7, 8), None, None, None))


def test_prefix_lookup_takes_the_longest_cached_run_and_leaves_the_last_token_to_compute():
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(12))
    computed(kv, make_request(prompt))
    exact = make_request(prompt)  # all three blocks cached, but the last token must produce logits
    assert kv.acquire_cached_prefix(exact) == 8 and exact.num_computed_tokens == 8
    diverging = make_request(prompt[:6] + [99] * 6)
    assert kv.acquire_cached_prefix(diverging) == 4  # stops at the first block that differs
    extended = make_request(prompt + [50, 51])
    assert kv.acquire_cached_prefix(extended) == 12
    assert (kv.hit_tokens, kv.queried_tokens) == (8 + 4 + 12, 8 + 8 + 12)


def test_a_request_scoring_its_prompt_skips_the_cache():
    kv = KVCacheManager(16, BLOCK)
    computed(kv, make_request(list(range(9))))
    scoring = make_request(list(range(9)), prompt_logprobs=True)
    assert kv.acquire_cached_prefix(scoring) == 0 and scoring.block_ids == []


def test_prefix_caching_off_registers_and_finds_nothing():
    kv = KVCacheManager(16, BLOCK, enable_prefix_caching=False)
    first = computed(kv, make_request(list(range(9))))
    assert first.block_hashes == [] and kv.pool.cached == {}
    assert kv.acquire_cached_prefix(make_request(list(range(9)))) == 0


def test_only_full_computed_blocks_are_registered():
    kv = KVCacheManager(16, BLOCK)
    request = make_request(list(range(10)))
    assert kv.allocate_slots(request, 10)
    request.num_computed_tokens = 7
    kv.cache_full_blocks(request)
    assert len(request.block_hashes) == 1
    request.num_computed_tokens = 10
    kv.cache_full_blocks(request)
    assert len(request.block_hashes) == 2 and len(kv.pool.cached) == 2


def test_freed_tail_blocks_are_reused_before_the_shared_head():
    """Freed blocks keep their prefix-cache entry until reused; a request frees tail first, so the pool
    reuses tails before the head that shorter prompts share."""
    kv = KVCacheManager(4, BLOCK)
    request = computed(kv, make_request(list(range(12))))
    head, middle, tail = request.block_ids
    kv.free(request)
    assert request.block_ids == [] and request.block_hashes == [] and kv.pool.num_free == 4
    assert kv.pool.allocate(2)[1:] == [tail]  # after the never-used block, the tail is taken first
    assert kv.pool.allocate(1) == [middle]
    again = make_request(list(range(4)) + [77, 78])
    assert kv.acquire_cached_prefix(again) == 4 and again.block_ids == [head]  # the head is still cached


def test_trim_frees_the_tail_blocks_only_discarded_tokens_needed():
    kv = KVCacheManager(8, BLOCK)
    request = make_request(list(range(6)))
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 5)  # room for 4 proposals and the next token: 11 tokens, 3 blocks
    kept = list(request.block_ids)
    assert len(kept) == 3
    kv.trim(request, 7)  # one kept token: 7 tokens need 2 blocks
    assert request.block_ids == kept[:2] and kv.pool.num_free == 6
    kv.trim(request, 8)  # nothing to trim
    assert request.block_ids == kept[:2] and kv.pool.num_free == 6
