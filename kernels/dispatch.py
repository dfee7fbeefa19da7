"""The one place that chooses an attention backend: it looks at the device of the tensors.

Nothing else in the engine knows which backend runs. CUDA tensors go to the Triton kernels when
Triton is importable; everything else goes to the PyTorch implementation.
"""

from __future__ import annotations

import torch

from . import torch_attention
from .metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new K/V `[T, KVH, D]` into the paged caches `[KVH, num_slots, D]`."""
    torch_attention.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed `query [T, H, D]` over the paged cache; returns `[T, H, D]`."""
    return torch_attention.paged_attention(
        query, key_cache, value_cache, metadata, scale, sliding_window, softcap, new_key, new_value
    )
