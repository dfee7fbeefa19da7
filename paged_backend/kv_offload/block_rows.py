"""BlockRows: one page's K/V rows copied off the pool, on their way to a tier or back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BlockRows:
    rows: torch.Tensor  # [layers on a page, k/v (or the one latent plane), kv_head, block_size, head_dim], on the host
    scales: torch.Tensor | None  # int8 K/V's scales, [layers, planes, kv_head, block_size]; None otherwise
    ready: torch.cuda.Event | None = None  # set when the copy off a GPU is still in flight

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def wait(self) -> None:
        """Block until the copy off the device has landed (no-op for a CPU pool)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
