"""BlockPool: the fixed set of KV blocks, their reference counts and the prefix-cache index.

A block is free when its reference count is zero. Free blocks wait in an LRU queue (an ordered
dict, so a cache hit can take a block out of the middle in O(1)). A full block may carry a hash of
its contents and stays findable by that hash after it is freed, until it is reused for other tokens:
evicting in LRU order keeps the most recently used prefixes. Requests free their blocks tail first,
so the tail of a sequence is evicted before its shared head.

With several layer groups (kv_cache_groups.py) every group draws its blocks from this one pool; a block
belongs to the group that allocated it until it is reused, and each group has its own prefix-cache
index, since the same tokens have other K/V in another group's layers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NewType

BlockHash = NewType("BlockHash", int)
# (parent block's hash, this block's tokens, and for a first block the request's cache salt, LoRA adapter id
# and model state)
BlockKey = tuple[BlockHash | None, tuple[int, ...], str | None, int | None, int | None]


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix cache, per layer group: hash -> block, and each cached block's hash and key, compared on
        # every hit.
        self.cached_by_group: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the group that last allocated the block
        self.used_by_group = [0] * num_groups  # blocks with references, per group

    @property
    def cached(self) -> dict[BlockHash, int]:
        """The first group's prefix-cache index (a model without windows has no other)."""
        return self.cached_by_group[0]

    @property
    def free_ids(self) -> list[int]:
        return list(self.free_queue)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """Take `n` free blocks (least recently used first) for `group`, each with reference count 1."""
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        ids = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for block_id in ids:
            self.evict(block_id)
            self.ref_counts[block_id] = 1
            self.block_group[block_id] = group
        self.used_by_group[group] += n
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with none left joins the end of the LRU queue."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_queue[block_id] = None
                self.used_by_group[self.block_group[block_id]] -= 1

    # ------------------------------------------------------------ prefix cache

    def find(self, block_hash: BlockHash, key: BlockKey, group: int = 0) -> int | None:
        """The cached block of `group` stored under `block_hash` with exactly this key, untouched."""
        block_id = self.cached_by_group[group].get(block_hash)
        # Comparing the key means a hash collision can never serve another sequence's K/V.
        if block_id is None or self.block_key[block_id] != key:
            return None
        return block_id

    def lookup(self, block_hash: BlockHash, key: BlockKey, group: int = 0) -> int | None:
        """find(), the block now referenced once more."""
        block_id = self.find(block_hash, key, group)
        if block_id is not None:
            self.take(block_id)
        return block_id

    def take(self, block_id: int) -> None:
        """One more reference to a block, which leaves the free queue if it was there."""
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
            self.used_by_group[self.block_group[block_id]] += 1
        self.ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: BlockHash, key: BlockKey) -> None:
        """Make a full block findable by its hash in its group (the first block with a hash keeps it)."""
        cached = self.cached_by_group[self.block_group[block_id]]
        if block_hash in cached or self.block_hash[block_id] is not None:
            return
        cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_key[block_id] = key

    def evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            cached = self.cached_by_group[self.block_group[block_id]]
            if cached.get(block_hash) == block_id:
                del cached[block_hash]
            self.block_hash[block_id] = None
            self.block_key[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so the next requests compute their prompts afresh (a benchmark's
        rounds, vLLM's `reset_prefix_cache`). Only while no block is in use: a running request's blocks
        would be registered again as it fills them. Returns whether the cache was reset."""
        if self.num_free != self.num_blocks:
            return False
        for cached in self.cached_by_group:
            cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_key = [None] * self.num_blocks
        return True
