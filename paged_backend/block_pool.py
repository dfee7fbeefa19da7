"""BlockPool: the fixed set of KV blocks, a free list and a reference count per block.

Block ids index the paged cache tensors. A block is free when its reference count is zero; the
free list is a deque so allocation and release are O(1) per block, with no per-step objects.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1."""
        if n > len(self.free_ids):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for block_id in ids:
            self.ref_counts[block_id] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free list."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_ids.append(block_id)
