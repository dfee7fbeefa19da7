"""KVCacheManager: gives each request the blocks its tokens need, shares cached prefixes, frees.

Automatic prefix caching: every full block is hashed in a chain (its parent's hash, its tokens,
and for the first block the request's cache salt, LoRA adapter and the model's state: its weights and PEFT adapters) and registered in the pool once computed. A new
request first takes the longest run of cached blocks matching its tokens and starts computing
after them; its last token is always computed, so there are logits to sample from.
"""

from __future__ import annotations

import hashlib
import struct

from paged_backend.core.block_pool import BlockHash, BlockKey, BlockPool
from paged_backend.core.request import Request


def hash_block(key: BlockKey) -> BlockHash:
    """A 128-bit hash of a block's key: collisions are astronomically rare, and hits compare keys anyway."""
    parent, tokens, salt, lora, model_state = key
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(b"-" if salt is None else b"+" + salt.encode())  # the marker keeps salt "" apart from no salt
    if lora is not None:  # the same tokens under another adapter have other K/V
        h.update(b"@" + lora.to_bytes(8, "little"))
    if model_state is not None:  # likewise after the model's weights or PEFT adapters changed
        h.update(b"#" + model_state.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return BlockHash(int.from_bytes(h.digest(), "little"))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def acquire_cached_prefix(self, request: Request) -> int:
        """Give a request with nothing computed the cached blocks of its longest cached prefix;
        return the number of tokens it can skip. A request that wants prompt logprobs skips the cache:
        a cached block has no logits to score its tokens with."""
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return 0
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs
        parent: BlockHash | None = None
        for i in range(limit):
            key = self.block_key(request, i, parent)
            block_hash = hash_block(key)
            block_id = self.pool.lookup(block_hash, key)
            if block_id is None:
                break
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
            parent = block_hash
        hit = len(request.block_ids) * bs
        self.queried_tokens += limit * bs
        self.hit_tokens += hit
        request.num_computed_tokens = hit
        return hit

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that the last step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_computed_tokens // self.block_size):
            key = self.block_key(request, i, hashes[-1] if hashes else None)
            block_hash = hash_block(key)
            self.pool.register(request.block_ids[i], block_hash, key)
            hashes.append(block_hash)

    def block_key(self, request: Request, index: int, parent: BlockHash | None) -> BlockKey:
        """Block `index` of the request: its parent's hash, its tokens, and (first block only) the salt, the
        adapter's registration id (unique, so a re-registered name never reuses its predecessor's K/V) and
        the model's state (model_state.py)."""
        bs = self.block_size
        tokens = tuple(request.token_slice(index * bs, (index + 1) * bs))
        if index:
            return parent, tokens, None, None, None
        lora = request.lora.id if request.lora is not None else None
        return parent, tokens, request.cache_salt, lora, request.model_state

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more computed tokens; False if full."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the tail blocks beyond those `num_tokens` need: blocks that held only tokens the request
        discarded (rejected speculative proposals). They were never full of kept tokens, so never cached."""
        keep = self.blocks_needed(num_tokens)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:][::-1])
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so the pool evicts tails before shared heads."""
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []
        request.block_hashes = []

    def slots_in_use(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free) * self.block_size
