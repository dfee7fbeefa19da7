"""Each kind of layer's spec, with no model: its answers at a few lengths to what the KV manager and the start-up plan
ask (the first block still needed and viewed, the blocks a lone request holds, the memory of a block or a state
slot, prefix caching, state slots), and the groups and manager built from specs alone."""

from __future__ import annotations

import pytest
import torch

from paged_backend.core.kv_cache_groups import plan_groups
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.layer_specs import (
    ChunkedAttentionSpec,
    FullAttentionSpec,
    LatentAttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    StateSpec,
    spec_of,
)
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.model.paged.paged_cache import KVShape
from paged_backend.sampling.sampling_params import SamplingParams

BLOCK = 4
POSITIONS = (0, 3, 4, 7, 8, 9, 15, 16, 33)
STATE = RecurrentStateSpec((StateSpec((3, 4)), StateSpec((2, 2, 2), torch.float32)))
SPECS = {
    "full": FullAttentionSpec(),
    "window8": SlidingWindowSpec(8),
    "chunk8": ChunkedAttentionSpec(8),
    "chunk6": ChunkedAttentionSpec(6),  # no multiple of the block: views start only where a chunk and a block do
    "latent": LatentAttentionSpec(32),
    "recurrent": STATE,
}
# name: (first needed block at each of POSITIONS, first viewed block there, blocks alone at 40 tokens with
# steps of 4 and of 40, planes, frees blocks, prefix caching, needs a state slot)
TABLE = {
    "full": ([0] * 9, [0] * 9, (10, 10), 2, False, True, False),
    "window8": ([0, 0, 0, 0, 0, 0, 2, 2, 6], [0, 0, 0, 0, 0, 0, 2, 2, 6], (4, 10), 2, True, True, False),
    "chunk8": ([0, 0, 0, 0, 2, 2, 2, 4, 8], [0, 0, 0, 0, 2, 2, 2, 4, 8], (4, 10), 2, True, True, False),
    "chunk6": ([0, 0, 0, 1, 1, 1, 3, 3, 7], [0, 0, 0, 0, 0, 0, 3, 3, 6], (4, 10), 2, True, True, False),
    "latent": ([0] * 9, [0] * 9, (10, 10), 1, False, True, False),
    "recurrent": ([0] * 9, [0] * 9, (0, 0), 0, False, False, True),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_each_kind_answers_what_the_manager_and_the_plan_ask(name: str) -> None:
    spec = SPECS[name]
    needed, viewed, alone, planes, frees, prefix, slot = TABLE[name]
    assert spec.name == name
    assert [spec.first_needed_block(p, BLOCK) for p in POSITIONS] == needed
    assert [spec.first_viewed_block(p, BLOCK) for p in POSITIONS] == viewed
    assert all(v <= n for v, n in zip(viewed, needed))  # a view never starts after a block a query reads
    assert (spec.blocks_alone(40, 4, BLOCK), spec.blocks_alone(40, 40, BLOCK)) == alone
    assert (spec.planes, spec.frees_blocks, spec.prefix_caching, spec.needs_state_slot) == (planes, frees, prefix, slot)
    assert spec.keeps_blocks == (planes > 0)
    assert spec.bytes_per_block(100, BLOCK) == planes * 100 * BLOCK
    assert not spec.keeping_every_block().frees_blocks


def test_a_chunked_view_starts_at_a_chunk_start() -> None:
    """The kernels find a query's chunk from its position in the view, so a view drops whole chunks only."""
    for spec in (ChunkedAttentionSpec(8), ChunkedAttentionSpec(6), ChunkedAttentionSpec(16)):
        for position in range(100):
            first = spec.first_viewed_block(position, BLOCK) * BLOCK
            assert first % spec.chunk == 0 and first <= position - position % spec.chunk


def test_a_recurrent_layer_keeps_a_state_slot_of_its_tensors() -> None:
    """3x4 in the model's dtype and an fp32 2x2x2, whatever the model's."""
    assert STATE.bytes_per_slot(torch.bfloat16) == 12 * 2 + 8 * 4
    assert STATE.bytes_per_slot(torch.float32) == 12 * 4 + 8 * 4
    assert FullAttentionSpec().bytes_per_slot(torch.float32) == 0


def test_a_model_shape_sums_its_layers() -> None:
    """Two K/V layers and a recurrent one: the block's memory is the two layers', the model shares no prefix and
    holds a slot per request; a latent model stores one plane."""
    hybrid = KVShape(2, 16, (FullAttentionSpec(), STATE, SlidingWindowSpec(8)))
    assert hybrid.bytes_per_block(BLOCK, torch.float32) == 2 * (2 * 2 * 16 * 4 * BLOCK)
    assert hybrid.bytes_per_block(BLOCK, torch.int8) == 2 * (2 * 2 * (16 + 4) * BLOCK)  # int8 rows and a scale
    assert (hybrid.planes, hybrid.prefix_caching, hybrid.needs_state_slots) == (2, False, True)
    latent = KVShape(1, 48, (LatentAttentionSpec(32),) * 3)
    assert (latent.planes, latent.prefix_caching, latent.needs_state_slots) == (1, True, False)
    assert latent.bytes_per_block(BLOCK, torch.float32) == 3 * 48 * 4 * BLOCK


def test_layers_group_by_spec_and_recurrent_layers_in_none() -> None:
    groups = plan_groups([ChunkedAttentionSpec(8), FullAttentionSpec(), STATE, ChunkedAttentionSpec(8),
                          SlidingWindowSpec(4), SlidingWindowSpec(4)])
    assert [(g.name, g.layers) for g in groups.groups] == [("full", (1,)), ("window4", (4,)), ("window4", (5,)),
                                                           ("chunk8", (0,)), ("chunk8", (3,))]
    assert groups.num_kv_layers == 5 and groups.frees_blocks
    latent = plan_groups([LatentAttentionSpec(32)] * 3)
    assert latent.num_groups == 1 and latent.groups[0].spec == LatentAttentionSpec(32) and latent.every_layer


def test_a_chunked_group_frees_the_chunks_behind_its_requests() -> None:
    """The manager asks the chunked spec as it asks a window's: at 20 computed tokens (chunk 8: the chunk from 16 on)
    the blocks before block 4 are back in the pool, and a prefix hit needs only the chunk behind it."""
    kv = KVCacheManager(64, BLOCK, groups=plan_groups([FullAttentionSpec(), ChunkedAttentionSpec(8)]))
    prompt = list(range(1, 30))
    request = Request("a", None, prompt, SamplingParams(max_tokens=1), 1, frozenset(), RequestMetrics(0.0))
    assert kv.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    kv.cache_full_blocks(request)
    assert kv.allocate_slots(request, 4)
    assert request.block_tables[1][:4] == [kv.null_block] * 4 and kv.null_block not in request.block_tables[1][4:]
    assert kv.null_block not in request.block_tables[0]
    second = Request("b", None, prompt[:21] + [99], SamplingParams(max_tokens=1), 1, frozenset(), RequestMetrics(0.0))
    assert kv.acquire_cached_prefix(second) == 20
    assert second.block_tables[1][:4] == [kv.null_block] * 4


@pytest.mark.parametrize(("seen", "spec"), [
    ({"keeps_rows": False, "states": (StateSpec((3, 4)),)}, RecurrentStateSpec((StateSpec((3, 4)),))),
    ({"keeps_rows": True, "latent_value_dim": 32}, LatentAttentionSpec(32)),
    ({"keeps_rows": True, "window": 8}, SlidingWindowSpec(8)),
    ({"keeps_rows": True, "chunk": 16}, ChunkedAttentionSpec(16)),
    ({"keeps_rows": True}, FullAttentionSpec()),
])
def test_what_the_probe_saw_picks_the_kind(seen: dict, spec) -> None:
    assert spec_of(**seen) == spec
