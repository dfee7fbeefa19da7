"""Attention and cache-write kernels behind one dispatcher (PyTorch on CPU, Triton on CUDA)."""

from .dispatch import paged_attention, use_backend, write_and_attend, write_kv_cache
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "use_backend", "write_and_attend", "write_kv_cache"]
