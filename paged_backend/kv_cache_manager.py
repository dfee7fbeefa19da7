"""KVCacheManager: gives each request the blocks its tokens need, and takes them back."""

from __future__ import annotations

from .block_pool import BlockPool
from .request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more computed tokens; False if full."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (newest first, so the tail of a sequence is reused first)."""
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []

    def slots_in_use(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free) * self.block_size
