"""A one-token step's write and attention in plain ops (torch_single_row.py) against the PyTorch backend's
attention of one sequence (attend_one, itself checked against dense attention)."""

from __future__ import annotations

import pytest
import torch
from paged_backend.kernels import AttentionMetadata, LayerAttention
from paged_backend.kernels.torch_attention import attend_one
from paged_backend.kernels.torch_single_row import (
    MIN_BLOCKS,
    single_row_step,
    write_and_attend_single_row,
)
from helpers.tolerances import tolerance

LAYERS, KV_HEADS, HEADS, DIM, BLOCK, BLOCKS = 2, 2, 6, 16, 4, 32


def one_token_step(length: int, blocks: list[int]) -> AttentionMetadata:
    """The metadata of a step where one sequence of `length` tokens (blocks `blocks`) computes its last one."""
    slot = blocks[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK
    return AttentionMetadata(
        slot_mapping=torch.tensor([slot]), block_tables=torch.tensor([blocks], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([length], dtype=torch.int32),
        block_size=BLOCK, query_start_loc_host=[0, 1], seq_lens_host=[length], max_query_len=1, max_seq_len=length)


@pytest.mark.parametrize("length", [1, 2, BLOCK, BLOCK + 1, 23])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_one_row_matches_dense(length, window, softcap, cache_dtype):
    torch.manual_seed(length)
    kv = torch.full((LAYERS, 2, KV_HEADS, BLOCKS * BLOCK, DIM), float("nan"), dtype=cache_dtype)  # as if unwritten
    blocks = torch.randperm(BLOCKS)[: -(-length // BLOCK)].tolist()
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    k = torch.randn(length, KV_HEADS, DIM).to(cache_dtype).float()  # as the cache stores them
    v = torch.randn(length, KV_HEADS, DIM).to(cache_dtype).float()
    layer = 1
    kv[layer, 0][:, slots[:-1]] = k[:-1].transpose(0, 1).to(cache_dtype)
    kv[layer, 1][:, slots[:-1]] = v[:-1].transpose(0, 1).to(cache_dtype)
    query = torch.randn(HEADS, DIM)
    step = single_row_step(one_token_step(length, blocks), kv)
    assert step.blocks.shape[0] >= MIN_BLOCKS
    attention = LayerAttention(0.25, window, softcap)
    out = write_and_attend_single_row(query, k[-1], v[-1], step, layer, attention)
    expected = attend_one(query[:, None], k.transpose(0, 1), v.transpose(0, 1), attention)[:, 0]
    torch.testing.assert_close(out, expected, **tolerance(torch.float32, "kernel"))
    # The new token landed in its slot, in that layer only.
    assert torch.equal(kv[layer, :, :, slots[-1]].float(), torch.stack([k[-1], v[-1]]))
    assert kv[0].isnan().all()
