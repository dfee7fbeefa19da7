"""One layer's part of the paged cache, as the kernels take it: the whole layer, or its K and V apart.

`LayerCache` is what a step hands a layer (step_context.py): its rows `kv [planes, KVH, num_slots, D]` (K and V,
or the one latent plane) and, for an int8 cache, their scales `[planes, KVH, num_slots]`. `PagedCaches` is the
same cache as the attention reads it, K and V apart, each `[KVH, num_slots, D]` with its scales `[KVH, num_slots]`:
a latent cache is both its keys and its values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedCaches(NamedTuple):
    """A layer's paged K and V caches `[KVH, num_slots, D]`, and their scales `[KVH, num_slots]` when int8."""
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None


class LayerCache(NamedTuple):
    """A layer's paged rows `kv [planes, KVH, num_slots, D]` and an int8 cache's scales `[planes, KVH, num_slots]`."""
    kv: torch.Tensor
    scales: torch.Tensor | None = None

    def key_value(self) -> PagedCaches:
        """Its K (plane 0) and V (plane 1)."""
        no_scales = self.scales is None
        return PagedCaches(self.kv[0], self.kv[1], None if no_scales else self.scales[0],
                           None if no_scales else self.scales[1])

    def latent(self) -> PagedCaches:
        """Its one latent plane, read as both the keys and the values."""
        scales = None if self.scales is None else self.scales[0]
        return PagedCaches(self.kv[0], self.kv[0], scales, scales)
