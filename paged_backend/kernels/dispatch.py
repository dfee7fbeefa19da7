"""The one place that chooses an attention backend: it looks at the device of the tensors.

Nothing else in the engine knows which backend runs. CUDA tensors go to the Triton kernels when
Triton is importable; everything else goes to the PyTorch implementation. The Triton modules are
imported on first CUDA use only, so a CPU process never pays for (or depends on) Triton, and a
test process can set TRITON_INTERPRET before they are first imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from types import ModuleType

import torch

from . import torch_attention
from .layer_attention import LayerAttention
from .layer_cache import LayerCache, PagedCaches
from .metadata import AttentionMetadata

# The Triton kernels' tiles hold a whole head (padded to a power of two) in registers; past 256
# they would spill, so larger heads (none of the supported models has one) use PyTorch. Below 16,
# `tl.dot` cannot compile (its reduction dimension must be at least 16), so smaller heads use
# PyTorch too. Every size in between is served, powers of two or not (80, 96: the tile is padded
# and the padding masked).
TRITON_MIN_HEAD_DIM = 16
TRITON_MAX_HEAD_DIM = 256
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_CACHE_DTYPES = TRITON_DTYPES + (torch.int8,)  # int8 with a scale per token and head
BACKENDS = ("torch", "triton")
_forced: str | None = None  # set by use_backend()


@functools.cache
def triton_modules() -> tuple[ModuleType, ModuleType] | None:
    """(attention, cache write) Triton modules, or None when Triton is not installed."""
    try:
        return (importlib.import_module(f"{__package__}.triton_attention"),
                importlib.import_module(f"{__package__}.triton_cache_write"))
    except ImportError:
        return None


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Route every call to backend `name` inside the block, whatever the device: to compare the
    backends on one GPU, or to run the Triton kernels through the interpreter on CPU tensors."""
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    if name == "triton" and triton_modules() is None:
        raise RuntimeError("the triton backend needs the `triton` package")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """'triton' for CUDA tensors Triton can serve, else 'torch'. use_backend() overrides the device
    rule, not the head sizes the kernels cannot compile for."""
    if not TRITON_MIN_HEAD_DIM <= head_dim <= TRITON_MAX_HEAD_DIM:
        return "torch"
    if _forced is not None:
        return _forced
    if device.type != "cuda" or dtype not in TRITON_CACHE_DTYPES:
        return "torch"
    return "triton" if triton_modules() is not None else "torch"


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's new K/V `[T, KVH, D]` into the paged caches `[KVH, num_slots, D]` (an int8 cache
    with its scales `[KVH, num_slots]`). Returns the K/V for the PyTorch attention's no-context
    shortcut: as the cache holds them on the PyTorch backend; the inputs on Triton, whose attention
    reads every key from the cache and never looks at them."""
    if select_backend(key_cache.device, key_cache.dtype, key_cache.shape[-1]) == "triton":
        triton_modules()[1].write_kv_cache(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
        return key, value
    return torch_attention.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)


def paged_attention(
    query: torch.Tensor,
    cache: PagedCaches,
    metadata: AttentionMetadata,
    layer: LayerAttention,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed `query [T, H, D]` over the paged `cache` with what `layer` asks for (its scale, and any
    window, soft-cap, ALiBi slopes, sinks or chunk: layer_attention.py); returns `[T, H, D]`.

    The cache may hold another dtype than the query (a low-precision KV cache): both backends read
    it in the query's dtype, an int8 cache times its `key_scales/value_scales [KVH, num_slots]`.

    ALiBi slopes (BLOOM, MPT, Falcon-RW, Baichuan-13B) add `slope * (key position - query position)` to each
    head's logits, after any soft-capping and before the causal mask. Sinks (gpt-oss) are a logit per head that
    joins each query row's softmax with no value, so they only take weight from the keys. A chunk (Llama 4's
    chunked layers) hides every key before the start of the query's chunk, `position - position % chunk`.

    `new_key`/`new_value` are this step's K/V, already written to the cache: the PyTorch backend
    reads them to skip a gather for sequences with no earlier context; the Triton kernel reads
    everything from the cache in the same launch, so it has no use for them.
    """
    # A step with images whose tokens attend both ways (metadata.widened) takes the PyTorch backend: the Triton
    # kernel's causal rule is built in.
    if select_backend(query.device, query.dtype, query.shape[-1]) == "triton" and metadata.widened is None:
        return triton_modules()[0].paged_attention(query, cache, metadata, layer)
    return torch_attention.paged_attention(query, cache, metadata, layer, new_key, new_value)


def write_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerCache,
    metadata: AttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:
    """What a layer does in a step, as one call: write its new `key/value [T, KVH, D]` into its paged cache
    (`cache.kv [2 (K, V), KVH, num_slots, D]`, an int8 one with `cache.scales [2, KVH, num_slots]`) at
    `metadata.slot_mapping`, as write_kv_cache() does, then attend `query [T, H, D]` over each sequence's
    context, those keys included, as paged_attention() does; returns `[T, H, D]`."""
    if select_backend(query.device, query.dtype, query.shape[-1]) == "triton" and metadata.widened is None:
        caches = cache.key_value()
        write_kv_cache(key, value, caches.key_cache, caches.value_cache, metadata.slot_mapping, caches.key_scales,
                       caches.value_scales)
        return paged_attention(query, caches, metadata, layer)
    return torch_attention.write_and_attend(query, key, value, cache, metadata, layer)


def write_and_attend_latent(
    query: torch.Tensor,
    latent: torch.Tensor,
    cache: LayerCache,
    metadata: AttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:
    """What a layer of multi-head latent attention does in a step (absorbed form): write its new `latent [T, 1, D]`
    into its paged cache (`cache.kv [1, 1, num_slots, D]`, an int8 one with `cache.scales [1, 1, num_slots]`) at
    `metadata.slot_mapping`, then attend `query [T, H, D]` over each sequence's latents as one shared key head
    whose value is the latent itself, at `layer.scale`; returns `[T, H, D]`. The caller keeps the value columns it
    needs (the latent's first kv_lora_rank): the others are the rotary key part, attended over at no other cost
    than their columns of the weighted sum, so the same cache serves as key and value, with no second copy or
    kernel."""
    caches = cache.latent()
    if select_backend(query.device, query.dtype, query.shape[-1]) == "triton":
        # The cache-write kernel stores a key and a value: given the latent as both, the second store rewrites
        # the same bytes, the price of one kernel for both layouts.
        triton_modules()[1].write_kv_cache(latent, latent, caches.key_cache, caches.value_cache,
                                           metadata.slot_mapping, caches.key_scales, caches.value_scales)
        return triton_modules()[0].paged_attention(query, caches, metadata, layer)
    return torch_attention.write_and_attend_latent(query, latent, caches, metadata, layer)
