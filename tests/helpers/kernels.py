"""Shared test helpers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from paged_backend.kernels import (
    AttentionMetadata,
    LayerAttention,
    PagedCaches,
    cpu_paged_attention,
    torch_attention,
    triton_attention,
)
from paged_backend.kernels.triton_attention import LaunchConfig

import helpers.triton_interpret  # noqa: F401,E402  (must precede every Triton kernel import)
from helpers.tolerances import tolerance

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


# Kernel output vs an fp32 oracle fed the same (rounded) inputs.


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D], non-contiguous like the engine's
    new_key: torch.Tensor  # [T, KVH, D]
    new_value: torch.Tensor
    key_cache: torch.Tensor  # [KVH, slots, D], context written, everything else NaN
    value_cache: torch.Tensor
    metadata: AttentionMetadata

    @property
    def caches(self) -> PagedCaches:
        return PagedCaches(self.key_cache, self.value_cache)


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int = 1,
    group: int = 1,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """A ragged step: sequence i has `seq_lens[i] - query_lens[i]` cached tokens and `query_lens[i]`
    new ones. Block ids are shuffled (non-contiguous tables) and spare/unwritten slots hold NaN, so
    any read past a sequence's length poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    slots_cached, slots_new, offset = [], [], 0
    for i, (n_new, n_all) in enumerate(zip(query_lens, seq_lens)):
        tables[i, : per_seq[i]] = ids[offset: offset + per_seq[i]]
        offset += per_seq[i]
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n_all)]
        slots_cached += slots[: n_all - n_new]
        slots_new += slots[n_all - n_new:]
    num_tokens, num_heads = sum(query_lens), num_kv_heads * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    caches = torch.full((2, num_kv_heads, num_blocks * block_size, head_dim), float("nan"), dtype=dtype)
    cached = torch.tensor(slots_cached, dtype=torch.int64)
    caches[:, :, cached] = rand(2, num_kv_heads, len(slots_cached), head_dim)
    new_key, new_value = rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim)
    caches[0][:, torch.tensor(slots_new, dtype=torch.int64)] = new_key.transpose(0, 1)
    caches[1][:, torch.tensor(slots_new, dtype=torch.int64)] = new_value.transpose(0, 1)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots_new, dtype=torch.int64, device=DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_size=block_size,
        query_start_loc_host=starts,
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    # [H, T, D] transposed to [T, H, D]: the layout the attention hook hands over.
    query = rand(num_heads, num_tokens, head_dim).to(DEVICE).transpose(0, 1)
    return Batch(query, new_key.to(DEVICE), new_value.to(DEVICE), caches[0].to(DEVICE), caches[1].to(DEVICE),
                 metadata)


def oracle(batch: Batch, scale: float, window: int | None = None, softcap: float | None = None):
    """The PyTorch backend in fp32 on CPU, fed the same rounded inputs as the kernel."""
    meta = batch.metadata
    cpu_meta = AttentionMetadata(
        meta.slot_mapping.cpu(), meta.block_tables.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(),
        meta.block_size, meta.query_start_loc_host, meta.seq_lens_host, meta.max_query_len, meta.max_seq_len,
    )
    with cpu_paged_attention.switched_off():  # PyTorch ops: an oracle that shares no code with a kernel
        return torch_attention.paged_attention(
            batch.query.float().cpu(), PagedCaches(batch.key_cache.float().cpu(), batch.value_cache.float().cpu()),
            cpu_meta, LayerAttention(scale, window, softcap),
        )


def check_attention(batch: Batch, config: LaunchConfig | None = None, **options) -> None:
    scale = batch.query.shape[-1] ** -0.5
    got = triton_attention.paged_attention(batch.query, batch.caches, batch.metadata, LayerAttention(scale, **options),
                                           config=config)
    want = oracle(batch, scale, **options)
    assert got.dtype == batch.query.dtype and got.shape == batch.query.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), want, **tolerance(batch.query.dtype, "kernel"))
