"""Layer specs: what each kind of layer keeps for a sequence, as the KV manager and the start-up plan ask it.

A model's layers come in kinds: full attention (every key), a sliding window of W keys, chunked attention
(keys from the start of the query's chunk of C positions on), multi-head latent attention (one latent row per
token instead of K and V) and a hybrid model's recurrent layers (a state per sequence, no rows at all). Each kind
is one frozen spec here, answering the same questions:

- `first_needed_block(position)`: the first block a query at `position`, or any later one, reads; the blocks
  before it can go back to the pool (`frees_blocks`), which only windows and chunks do;
- `first_viewed_block(position)`: the block a step's attention may be handed its sequence from without changing
  what its mask shows the queries (the runner crops block tables there);
- `blocks_alone(...)`: the blocks a lone request holds at its largest, which bounds the context the cache holds;
- `planes` and `bytes_per_block(...)`: the rows a token keeps per head (K and V: 2, a latent: 1, a state: 0) and
  the memory of one block; `bytes_per_slot(...)`: the memory of one sequence's state;
- `prefix_caching` and `needs_state_slot`: whether a cached K/V prefix can be shared (a recurrent state cannot be
  rebuilt from one), and whether each request holds a state slot.

Equal specs share a layer group (kv_cache_groups.py), so a new kind of layer is a new class here (and its kernel),
and the manager and the plan ask it the same questions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch


class StateSpec(NamedTuple):
    """One state tensor of one sequence in one recurrent layer."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the model's (a Mamba-2 SSM state is fp32, as transformers keeps it)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """A layer that keeps the K and V of every token: what the other kinds differ from."""

    planes: ClassVar[int] = 2  # rows each token keeps per head: K and V
    prefix_caching: ClassVar[bool] = True  # a cached prefix's blocks serve a new request
    needs_state_slot: ClassVar[bool] = False  # each request holds a state slot

    @property
    def name(self) -> str:
        return "full"

    @property
    def keeps_blocks(self) -> bool:
        """Whether the layer keeps rows in the pages (a recurrent layer keeps its state in state slots)."""
        return self.planes > 0

    @property
    def reach(self) -> int | None:
        """The most keys a query reads, itself included (None: all before it)."""
        return None

    @property
    def frees_blocks(self) -> bool:
        """Whether blocks go back to the pool while the sequence still grows."""
        return self.reach is not None

    @property
    def order(self) -> tuple[bool, int, str]:
        """Where its groups come in the cache's group order (stats and metrics show it): layers keeping every block
        first, then from the smallest reach."""
        return self.reach is not None, self.reach or 0, self.name

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block a query at `position` (or any later one) reads."""
        return 0

    def first_viewed_block(self, position: int, block_size: int) -> int:
        """The first block the attention of a step whose first query sits at `position` is handed: dropping whole
        blocks before it (the sequence's length with them) changes nothing the mask lets the queries see."""
        return self.first_needed_block(position, block_size)

    def blocks_alone(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        """Blocks a lone request holds at its largest with `num_tokens` tokens, a step computing at most
        `step_tokens` of them."""
        return blocks_for(num_tokens, block_size)

    def bytes_per_block(self, plane_bytes: int, block_size: int) -> int:
        """Memory of one block of this layer, where one token's row of one plane, every head, is `plane_bytes`."""
        return self.planes * plane_bytes * block_size

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Memory of one sequence's state (0: the layer keeps none)."""
        return 0

    def keeping_every_block(self) -> LayerSpec:
        """This layer's spec in a cache where no layer frees blocks (one block table for all): its attention still
        masks as before, its blocks stay."""
        return self


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(LayerSpec):
    """Attention over every key before the query."""


def window_blocks_alone(reach: int, num_tokens: int, step_tokens: int, block_size: int) -> int:
    """Blocks held at most by a layer whose query reads at most `reach` keys: those behind the step's first query
    and those the step writes (+1: the first key read may sit anywhere in its block), never more than all."""
    return min(blocks_for(num_tokens, block_size), blocks_for(reach - 1 + step_tokens, block_size) + 1)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(LayerSpec):
    """Attention over the last `window` keys, the query's own included: a key more than `window - 1` positions
    behind the query is never read again."""

    window: int

    @property
    def name(self) -> str:
        return f"window{self.window}"

    @property
    def reach(self) -> int:
        return self.window

    def first_needed_block(self, position: int, block_size: int) -> int:
        return max(0, position - self.window + 1) // block_size

    def blocks_alone(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        return window_blocks_alone(self.window, num_tokens, step_tokens, block_size)

    def keeping_every_block(self) -> LayerSpec:
        return FullAttentionSpec()


@dataclass(frozen=True, slots=True)
class ChunkedAttentionSpec(LayerSpec):
    """Attention over the keys of the query's own chunk of `chunk` positions (Llama 4): a query at `p` reads from
    `p - p % chunk` on, so once a sequence enters a chunk the ones before it are never read again."""

    chunk: int

    @property
    def name(self) -> str:
        return f"chunk{self.chunk}"

    @property
    def reach(self) -> int:
        return self.chunk

    def first_needed_block(self, position: int, block_size: int) -> int:
        return (position - position % self.chunk) // block_size

    def first_viewed_block(self, position: int, block_size: int) -> int:
        """The kernels find a query's chunk from its position in the sequence they are handed, so a view may drop
        only whole chunks: the last block start at or before the chunk's that is also a chunk start."""
        start = position - position % self.chunk
        return (start - start % math.lcm(self.chunk, block_size)) // block_size

    def blocks_alone(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        # A chunk starts at most `chunk - 1` positions behind its query, as a window of `chunk` keys does.
        return window_blocks_alone(self.chunk, num_tokens, step_tokens, block_size)

    def keeping_every_block(self) -> LayerSpec:
        return FullAttentionSpec()


@dataclass(frozen=True, slots=True)
class LatentAttentionSpec(LayerSpec):
    """Multi-head latent attention (DeepSeek-V3): one latent row per token, shared by every head, whose first
    `value_dim` entries are also its value (model/paged/latent_cache.py)."""

    planes: ClassVar[int] = 1
    value_dim: int

    @property
    def name(self) -> str:
        return "latent"


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec(LayerSpec):
    """A hybrid model's recurrent layer (Mamba-2, a short convolution, gated delta-net): no rows in the pages, a
    state per sequence in a state slot (model/paged/recurrent_state.py). A state after a prefix cannot be rebuilt from
    that prefix's cached K/V, so a model with one shares no prefix."""

    planes: ClassVar[int] = 0
    prefix_caching: ClassVar[bool] = False
    needs_state_slot: ClassVar[bool] = True
    states: tuple[StateSpec, ...] = ()

    @property
    def name(self) -> str:
        return "recurrent"

    def blocks_alone(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        return 0

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Its state tensors' memory, those without a dtype of their own in the model's `dtype`."""
        return sum(math.prod(state.shape) * (state.dtype or dtype).itemsize for state in self.states)


def spec_of(*, keeps_rows: bool, latent_value_dim: int | None = None, window: int | None = None,
            chunk: int | None = None, states: tuple[StateSpec, ...] = ()) -> LayerSpec:
    """The spec of a layer from what the start-up probe saw it do: no rows (a recurrent layer, whose state tensors
    are `states`), a latent row of which the first `latent_value_dim` entries are the value, or K and V under a
    sliding `window`, a `chunk` or neither. The one place a layer's kind is decided: a new kind is a class above and
    a branch here."""
    if not keeps_rows:
        return RecurrentStateSpec(states)
    if latent_value_dim is not None:
        return LatentAttentionSpec(latent_value_dim)
    if window is not None:
        return SlidingWindowSpec(window)
    if chunk is not None:
        return ChunkedAttentionSpec(chunk)
    return FullAttentionSpec()
