"""KV cache groups: which layers share a block table, and how much of a sequence each group must keep.

Each layer has a spec (layer_specs.py) saying which blocks a query still reads: a sliding-window or chunked layer
lets the blocks behind its window or chunk go back to the pool as a sequence grows, a full-attention or latent
layer keeps every block. Layers are therefore split into groups by spec, and each group has its own block table
per request, so a window group can free its old blocks while a full group keeps them.

All groups draw from one pool of pages. A page holds one block of `group_size` layers, so a page
serves any group: the cache tensor is `[group_size, k/v, kv_head, slot, head_dim]` and layer `l` reads
position `layer_position[l]` of it, through the block table of its group `layer_group[l]`. Each kind
of layer (one spec) is cut into groups of `group_size` layers, where `group_size` is the
smallest number of layers of any kind: Gemma 3 (five sliding layers to one full) gets groups of one
layer; a model whose layers all slide alike gets one group of all its layers. A kind whose count is no
multiple of `group_size` leaves positions of its last group's pages unused.

A model whose layers all keep every block alike gets one group of every layer: its pages are exactly the blocks
it always had. A hybrid model's recurrent layers keep no rows (their state lives in state slots): they belong to
no group and have no position in the pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paged_backend.core.layer_specs import FullAttentionSpec, LayerSpec

# A context no request reaches: the capacity of a cache whose every group slides (a lone request never
# outgrows its windows).
UNBOUNDED_TOKENS = 2**40


@dataclass(frozen=True, slots=True)
class LayerGroup:
    spec: LayerSpec  # what each of its layers keeps
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class CacheGroups:
    groups: tuple[LayerGroup, ...]
    group_size: int  # layers per page
    layer_group: tuple[int, ...]  # layer -> its group
    layer_position: tuple[int, ...]  # layer -> its index in the cache tensor's first dimension

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V (all but a hybrid model's recurrent ones)."""
        return sum(len(group.layers) for group in self.groups)

    @property
    def every_layer(self) -> bool:
        """Whether layer `l` sits at position `l` of the pages: the layout of a cache without groups, where layer `l`
        is `kv[l]`."""
        return self.layer_position == tuple(range(self.num_layers))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Whether some group lets blocks go as a sequence grows (so the layout differs from one table)."""
        return any(group.spec.frees_blocks for group in self.groups)

    def pages_for(self, num_blocks: int) -> int:
        """Pages holding the memory of `num_blocks` blocks of every layer that keeps K/V."""
        return num_blocks * self.num_kv_layers // self.group_size

    def blocks_alone(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        """Pages a lone request holds at its largest, when it has `num_tokens` tokens and a step computes
        at most `step_tokens` of them: what each group's spec holds at most (a full group all its blocks, a
        window group those of the window behind the step's first query and those the step writes)."""
        return sum(group.spec.blocks_alone(num_tokens, step_tokens, block_size) for group in self.groups)

    def capacity_tokens(self, num_blocks: int, block_size: int, step_tokens: int | None) -> int:
        """The longest request that fits alone in a pool of `num_blocks` pages, when a step computes at most
        `step_tokens` of its tokens (None: all of them); UNBOUNDED_TOKENS when every group slides."""
        def pages(num_tokens: int) -> int:
            return self.blocks_alone(num_tokens, num_tokens if step_tokens is None else min(num_tokens, step_tokens),
                                     block_size)

        if not self.frees_blocks:
            return num_blocks * block_size
        if pages(UNBOUNDED_TOKENS) <= num_blocks:
            return UNBOUNDED_TOKENS
        low, high = 0, num_blocks * block_size  # a full group alone bounds it by this
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if pages(mid) <= num_blocks else (low, mid - 1)
        return low


def one_group(num_layers: int, spec: LayerSpec = FullAttentionSpec()) -> CacheGroups:
    """Every layer in one group of `spec` (one that keeps every block): the layout of a model without windows, and
    of any model when out-of-window blocks are not freed."""
    return CacheGroups((LayerGroup(spec, tuple(range(num_layers))),), num_layers,
                       (0,) * num_layers, tuple(range(num_layers)))


def plan_groups(specs: Sequence[LayerSpec]) -> CacheGroups:
    """Groups for layers of these specs, in layer order within each kind; layers that keep no rows (a hybrid's
    recurrent ones) in none (their group and position entries are 0, never read)."""
    kinds: dict[LayerSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec.keeps_blocks:
            kinds.setdefault(spec, []).append(layer)
    if len(kinds) == 1 and len(set(specs)) == 1 and not specs[0].frees_blocks:
        return one_group(len(specs), specs[0])  # every layer alike, keeping every block
    size = min(len(layers) for layers in kinds.values())
    groups: list[LayerGroup] = []
    layer_group = [0] * len(specs)
    layer_position = [0] * len(specs)
    for spec in sorted(kinds, key=lambda spec: spec.order):
        layers = kinds[spec]
        for start in range(0, len(layers), size):
            members = tuple(layers[start:start + size])
            for position, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_position[layer] = position
            groups.append(LayerGroup(spec, members))
    return CacheGroups(tuple(groups), size, tuple(layer_group), tuple(layer_position))
