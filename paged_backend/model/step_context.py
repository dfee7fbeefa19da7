"""The step context: what one step's layers read, set once around each forward by whoever runs it (the model
runner's steps, its compile warm-up and its CUDA graph capture).

transformers calls the layers with its own arguments only, so what belongs to the step reaches them here: the
attention metadata (and each layer group's, with the groups), the paged cache and an int8 cache's scales, the
adapter each token runs with (`LoRAStep`), a hybrid model's recurrent state with each sequence's place in it, and
whether fused projections compute their group at once. The attention ops read it when they run (custom_ops.py),
never as graph inputs, so one compiled graph serves every step; the LoRA hooks and fused projections read it
as the graph is traced (their mask becomes a graph input, the flag a constant of the graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_backend.core.kv_cache_groups import CacheGroups
from paged_backend.kernels import AttentionMetadata
from paged_backend.model.recurrent_state import RecurrentState, RecurrentStep


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

    def layer_step(self, layer: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor | None]:
        """The metadata, cache and scales `layer` reads and writes."""
        if self.groups is None:
            return self.metadata, self.kv[layer], None if self.kv_scales is None else self.kv_scales[layer]
        position = self.groups.layer_position[layer]
        return (self.group_metadata[self.groups.layer_group[layer]], self.kv[position],
                None if self.kv_scales is None else self.kv_scales[position])

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
