"""A one-token step's cache write and attention in plain tensor ops, for the compiler to fuse (CPU,
compiled forward).

A step of one packed token (a lone stream decoding, or a one-token chunk) has one query row over one
sequence's context. Through the opaque custom op a compiled forward calls for every other step, a layer
pays the op's dispatch and a dozen eager ops. Written here as plain ops over the paged cache and the
block table, inductor fuses the write, the gather, the scores, the softmax and the weighted sum into one
C++ kernel per layer (docs/compiled-steps.md has its time). Every input is a tensor whose sizes the compiler keeps
symbolic (the block count), so one graph serves every context length.

The cache is a graph input that the graph mutates. The write is an `index_put_` on the whole cache tensor
with one index per dimension, which inductor performs in place; written through a view of one layer
(`index_copy_` on `kv[layer, 0]`), it copied the whole cache instead, per layer (docs/compiled-steps.md).
Positions past the sequence are masked (the cache is allocated empty, so they may hold NaN), and the
weighted sum zeroes their values rather than trusting a zero weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layer_attention import LayerAttention
from .metadata import AttentionMetadata

# A block count of 0 or 1 would be specialised by the compiler (a recompile per case); a step's blocks
# are padded to at least this many with block 0, whose positions are masked.
MIN_BLOCKS = 2


class SingleRowStep(NamedTuple):
    """What a one-token step's attention reads, as forward inputs: the paged cache `kv [layers, 2, KVH,
    slots, D]`, the new token's slot, the sequence's blocks `[>= MIN_BLOCKS]` and its length (its new token
    included). The slot and the length are 0-d: traced under `backed_size_oblivious` (compilation.py), a
    size-1 dimension is not taken to broadcast, and a `[1]` length compared with `[N]` positions was read as
    N lengths."""
    kv: torch.Tensor
    slot: torch.Tensor
    blocks: torch.Tensor
    seq_len: torch.Tensor
    block_size: int


def single_row_step(metadata: AttentionMetadata, kv: torch.Tensor) -> SingleRowStep:
    """The inputs of write_and_attend_single_row() for a step of one packed token (which always has a slot)."""
    blocks = metadata.block_tables[0]
    if blocks.shape[0] < MIN_BLOCKS:
        blocks = torch.cat([blocks, blocks.new_zeros(MIN_BLOCKS - blocks.shape[0])])
    return SingleRowStep(kv, metadata.slot_mapping[0], blocks, metadata.seq_lens[0], metadata.block_size)


def write_and_attend_single_row(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: SingleRowStep,
    index: int | torch.Tensor,
    layer: LayerAttention,
) -> torch.Tensor:
    """Write the step's `key/value [KVH, D]` into layer `index` of `step.kv` at `step.slot`, then attend its
    one `query [H, D]` over the sequence's context there, in fp32, with what `layer` asks for (its window, chunk,
    soft-cap and sinks; the paths with ALiBi slopes are adapters', which call the op); returns `[H, D]`."""
    kv_heads, dim = key.shape
    heads = torch.arange(kv_heads, device=key.device)
    # The layer as an index tensor, never a Python int in the graph: a compiled forward gives it as a 0-d tensor
    # input, so every layer traces the same graph (model/compiled/layer_regions.py).
    index = torch.as_tensor(index, device=key.device)
    for half, new in enumerate((key, value)):
        where = (index, torch.tensor(half, device=key.device), heads, step.slot)
        step.kv.index_put_(where, new.to(step.kv.dtype))
    slots = (step.blocks[:, None] * step.block_size + torch.arange(step.block_size, device=key.device)).flatten()
    # Two index tensors apart put the gathered positions first: [N, 2, KVH, D] -> [2, KVH, N, D].
    context = step.kv[index.view(1), :, :, slots].permute(1, 2, 0, 3)
    positions = torch.arange(context.shape[2], device=query.device)
    allowed = positions < step.seq_len
    if layer.window is not None:
        allowed &= positions > step.seq_len - 1 - layer.window
    if layer.chunk is not None:
        query_position = step.seq_len - 1
        allowed &= positions >= query_position - query_position % layer.chunk
    q = query.reshape(kv_heads, -1, dim).float()
    scores = (q[:, :, None, :] * context[0].float()[:, None]).sum(-1) * layer.scale  # [KVH, group, N]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if layer.sinks is not None:  # one more logit per head, whose weight is dropped after the softmax
        sink = layer.sinks.float().view(kv_heads, -1, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    values = torch.where(allowed[:, None], context[1].float(), 0.0)[:, None]  # [KVH, 1, N, D]
    return (weights[..., None] * values).sum(-2).reshape(-1, dim).to(query.dtype)
