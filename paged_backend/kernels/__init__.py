"""Attention and cache-write kernels behind one dispatcher (PyTorch on CPU, Triton on CUDA)."""

from .dispatch import paged_attention, use_backend, write_and_attend, write_kv_cache
from .layer_attention import LayerAttention
from .layer_cache import LayerCache, PagedCaches
from .metadata import AttentionMetadata, pack_sequences, to_device

__all__ = ["AttentionMetadata", "LayerAttention", "LayerCache", "PagedCaches", "pack_sequences", "paged_attention",
           "to_device", "use_backend", "write_and_attend", "write_kv_cache"]
