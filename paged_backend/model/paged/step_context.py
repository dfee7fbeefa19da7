"""The step context: what one step's layers read, set once around each forward by whoever runs it (the model
runner's steps, its compile warm-up and its CUDA graph capture).

transformers calls the layers with its own arguments only, so what belongs to the step reaches them here: the
attention metadata (and each layer group's, with the groups), the paged cache and an int8 cache's scales, the
adapter each token runs with (`LoRAStep`), a hybrid model's recurrent state with each sequence's place in it, and
whether fused projections compute their group at once. It also carries each layer's attention record
(LayerAttention, given once at start-up), so that an op, which can take a layer's index but not its record,
finds the record by that index, as vLLM's forward context finds a layer by its name. The attention ops read it
when they run (custom_ops.py), never as graph inputs, so one compiled graph serves every step; the LoRA hooks,
fused projections and the one-token attention traced into a CPU graph read it as the graph is traced (their mask
becomes a graph input; the flag and a layer's record, constants of the graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_backend.core.kv_cache_groups import CacheGroups
from paged_backend.kernels import AttentionMetadata, LayerAttention, LayerCache
from paged_backend.model.paged.recurrent_state import RecurrentState, RecurrentStep


@dataclass(slots=True)
class LoRAStep:
    """Which adapter each packed token runs with, as a mask over the stacked slots' rank columns:
    `mask[t, (s - 1) * max_rank + j]` is 1 when token t runs with the adapter in slot s >= 1, else 0
    (the base, slot 0, has no columns)."""

    mask: torch.Tensor  # [T, max_loras * max_rank]
    owner: object  # the LoRASlots whose slots the mask indexes: only that engine's hooks apply it


@dataclass(slots=True)
class StepContext:
    metadata: AttentionMetadata | None  # None: a step whose layers attend through no paged cache (tests)
    kv: torch.Tensor  # the paged cache [layers, 2, KVH, slots, D]
    kv_scales: torch.Tensor | None = None  # an int8 cache's scales [layers, 2, KVH, slots]
    # Layer groups with block tables of their own (kv_cache_groups.py): each group's metadata, and the groups
    # (layer -> group, and its position in `kv`). None: every layer reads `kv[layer]` through `metadata`.
    group_metadata: tuple[AttentionMetadata, ...] | None = None
    groups: CacheGroups | None = None
    lora: LoRAStep | None = None  # None: every token runs the base model
    recurrent: RecurrentState | None = None  # a hybrid model's recurrent-layer state
    recurrent_step: RecurrentStep | None = None  # each sequence's rows, progress and state slot in it
    fused: bool = False  # fused projections compute their group at once (fused_projections.py)
    # Each layer's attention record by layer index (KVShape.attention, from the start-up probe); None for a layer
    # with no attention.
    attention: tuple[LayerAttention | None, ...] = ()

    def layer_step(self, layer: int) -> tuple[AttentionMetadata, LayerCache, LayerAttention]:
        """The metadata and cache `layer` reads and writes, and what its attention computes."""
        if self.groups is None:
            metadata, position = self.metadata, layer
        else:
            metadata, position = self.group_metadata[self.groups.layer_group[layer]], self.groups.layer_position[layer]
        scales = None if self.kv_scales is None else self.kv_scales[position]
        return metadata, LayerCache(self.kv[position], scales), self.layer_attention(layer)

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s attention record."""
        record = self.attention[layer] if layer < len(self.attention) else None
        if record is None:
            raise RuntimeError(f"layer {layer} attended inside an engine step without an attention record: the "
                               "start-up probe (paged_cache.probe_kv_shape) records one for every layer it reaches")
        return record

    def recurrent_state(self) -> tuple[RecurrentState, RecurrentStep]:
        """A hybrid model's state and this step's place in it, which its recurrent mixers read."""
        if self.recurrent is None or self.recurrent_step is None:
            raise RuntimeError("a hybrid model's recurrent mixer ran inside an engine step without its recurrent state")
        return self.recurrent, self.recurrent_step


_current: StepContext | None = None  # set by step_context() around one step's forward


@contextlib.contextmanager
def step_context(context: StepContext) -> Iterator[None]:
    """Make `context` what the step's layers read while the block runs."""
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous


def current() -> StepContext | None:
    """The open step's context, or None outside an engine step."""
    return _current


def in_step() -> bool:
    """Whether an engine step's forward is running (a step context is open)."""
    return _current is not None


def current_step() -> StepContext:
    if _current is None:
        raise RuntimeError("paged_backend ops called outside an engine step (no step_context)")
    return _current
