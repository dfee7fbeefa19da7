"""KVCacheManager: gives each request the blocks its tokens need, shares cached prefixes, frees.

Automatic prefix caching: every full block is hashed in a chain (its parent's hash, its tokens and the images
among them, and for the first block the request's cache salt, LoRA adapter and the model's state: its weights and PEFT adapters) and registered in the pool once computed. A new
request first takes the longest run of cached blocks matching its tokens and starts computing
after them; its last token is always computed, so there are logits to sample from.

Layer groups (kv_cache_groups.py): each request has a block table per group, and each group's layer spec
(layer_specs.py) says which blocks its queries still read. A group whose spec frees blocks (a sliding window, a
chunk) lets go of the blocks before the first one it needs as the request grows: before each step, blocks no
query of the step or of any later step reads go back to the pool, their table entries pointing at the null
block (a page outside the pool, zeroed, which no step writes), so the tables keep their positions; the runner
hands such a group's attention only the blocks from the first one its spec lets it view (ModelRunner._cropped_view).
A freed block keeps its prefix-cache entry until reused, like any freed block. A cached prefix is a hit
only where every group can serve it: each group needs the blocks from the first one its spec says the first
query after the hit reads (a full group: every block before the hit point), so the hit is the longest prefix
that all groups hold.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

from paged_backend.core.block_pool import BlockHash, BlockKey, BlockPool
from paged_backend.core.image_span import block_images
from paged_backend.core.kv_cache_groups import CacheGroups, one_group
from paged_backend.core.layer_specs import LayerSpec
from paged_backend.core.request import Request
from paged_backend.core.state_slots import StateSlots

if TYPE_CHECKING:  # built by the engine when a second tier is configured
    from paged_backend.kv_offload.offloader import KVOffloader


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: CacheGroups | None = None, max_step_tokens: int | None = None,
                 state_slots: StateSlots | None = None) -> None:
        """`groups`: the layer groups (None: one group of every layer, keeping every block). `max_step_tokens`:
        the most tokens one step computes for a request, which a group that frees blocks must hold besides
        those its spec still reads (None: a whole request's). `state_slots`: a hybrid model's recurrent-state slots, one held by
        each request from its first blocks until they are freed (None: the model has no recurrent layers)."""
        self.block_size = block_size
        self.groups = groups or one_group(1)
        self.pool = BlockPool(num_blocks, self.groups.num_groups)
        self.null_block = num_blocks  # the page after the pool's: what freed table entries point at
        self.max_step_tokens = max_step_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.offload: KVOffloader | None = None  # the second tier behind the pool (kv_offload/), if any

    @property
    def capacity_tokens(self) -> int:
        """The longest request that fits in the cache alone (so preemption can always make room for it)."""
        return self.groups.capacity_tokens(self.pool.num_blocks, self.block_size, self.max_step_tokens)

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
        if self.offload is not None and self.offload.serves(request) and not request.recompute:
            self.restore_prefix(request, limit)
        if self.groups.frees_blocks:
            num_hit = self.take_grouped_prefix(request, limit)
        else:
            num_hit = self.take_prefix(request, limit)
        hit = num_hit * bs
        self.queried_tokens += limit * bs
        self.hit_tokens += hit
        request.num_computed_tokens = hit
        return hit

    def restore_prefix(self, request: Request, limit: int) -> None:
        """Bring back from the second tier the blocks of the request's first `limit` that the pool lacks, into free
        pages registered in the prefix cache, for the hit that follows to take. Groups keeping every block first:
        the run they all hold ends the hit, and a group that frees blocks needs only those behind that point.
        Blocks of the prefix already in the pool are held meanwhile, so reading the next ones in cannot evict
        them; room is left for the request's first chunk."""
        keys, hashes = self.prefix_keys(request, limit)
        step = min(request.num_tokens, self.max_step_tokens or request.num_tokens)
        reserve = self.blocks_needed(step) * self.groups.num_groups
        held: list[int] = []
        swap = request.metrics.num_preemptions > 0
        groups = self.groups.groups
        keeping = [g for g, group in enumerate(groups) if not group.spec.frees_blocks]
        hit = self.restore_run(keys, hashes, keeping, 0, limit, held, reserve, swap) if keeping else limit
        for g, group in enumerate(groups):
            if group.spec.frees_blocks:
                first = group.spec.first_needed_block(hit * self.block_size, self.block_size)
                self.restore_run(keys, hashes, [g], first, hit, held, reserve, swap)
        self.pool.free(held[::-1])  # tail first, as a request frees

    def restore_run(self, keys: list[BlockKey], hashes: list[BlockHash], groups: list[int], start: int, stop: int,
                    held: list[int], reserve: int, swap: bool) -> int:
        """Hold blocks `start`..`stop` of `groups` in the pool, reading from the tier those it lacks, until one is
        in neither (or only `reserve` free blocks are left); return the index where the run ends."""
        for i in range(start, stop):
            for g in groups:
                block_id = self.pool.lookup(hashes[i], keys[i], g)
                if block_id is None:
                    if self.pool.num_free <= reserve:
                        return i
                    block_id = self.pool.allocate(1, g)[0]
                    if not self.offload.load(keys[i], hashes[i], g, block_id, swap):
                        self.pool.free([block_id])
                        return i
                    self.pool.register(block_id, hashes[i], keys[i])
                held.append(block_id)
        return stop

    def take_prefix(self, request: Request, limit: int) -> int:
        """One group keeping every block: take the longest run of cached blocks; return its length."""
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
        return len(request.block_ids)

    def take_grouped_prefix(self, request: Request, limit: int) -> int:
        """Several groups: the longest prefix of blocks (at most `limit`) every group can serve, taken;
        return its length in blocks."""
        keys, hashes = self.prefix_keys(request, limit)
        groups = self.groups.groups
        keeping = [g for g, group in enumerate(groups) if not group.spec.frees_blocks]
        hit = limit
        for g in keeping:  # a group keeping every block serves the run of blocks it holds from the start
            hit = next((i for i in range(hit) if self.pool.find(hashes[i], keys[i], g) is None), hit)
        while hit > 0:  # a freeing group serves a hit whose needed blocks it holds; else the hit must end earlier
            missing = self.missing_behind(keys, hashes, hit)
            if missing is None:
                break
            hit = missing
        self.ensure_tables(request)
        for g, group in enumerate(groups):
            first = group.spec.first_needed_block(hit * self.block_size, self.block_size)
            table = request.block_tables[g]
            table.extend([self.null_block] * first)
            for i in range(first, hit):
                table.append(self.pool.lookup(hashes[i], keys[i], g))
        request.block_hashes.extend(hashes[:hit])
        return hit

    def prefix_keys(self, request: Request, limit: int) -> tuple[list[BlockKey], list[BlockHash]]:
        """The keys and chain hashes of the request's first `limit` blocks."""
        keys: list[BlockKey] = []
        hashes: list[BlockHash] = []
        for i in range(limit):
            keys.append(self.block_key(request, i, hashes[-1] if hashes else None))
            hashes.append(hash_block(keys[-1]))
        return keys, hashes

    def missing_behind(self, keys: list[BlockKey], hashes: list[BlockHash], hit: int) -> int | None:
        """The last block a group that frees blocks would read after a hit of `hit` blocks and has not cached."""
        bs = self.block_size
        for g, group in enumerate(self.groups.groups):
            if not group.spec.frees_blocks:
                continue
            for i in range(hit - 1, group.spec.first_needed_block(hit * bs, bs) - 1, -1):
                if self.pool.find(hashes[i], keys[i], g) is None:
                    return i
        return None

    def ensure_tables(self, request: Request) -> None:
        """Give a request one block table per group (a fresh request has the one of a single group)."""
        if len(request.block_tables) != self.groups.num_groups:
            request.block_tables = [[] for _ in self.groups.groups]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that the last step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_computed_tokens // self.block_size):
            key = self.block_key(request, i, hashes[-1] if hashes else None)
            block_hash = hash_block(key)
            # A block is freed by its group only at the next step's allocation, after this: every
            # group's block i is still held here.
            for table in request.block_tables:
                self.pool.register(table[i], block_hash, key)
            if self.offload is not None and self.offload.serves(request):
                self.offload.save(key, block_hash, [table[i] for table in request.block_tables])
            hashes.append(block_hash)

    def prompt_key(self, request: Request) -> int | None:
        """A key equal for requests whose whole prompt would have the same K/V (its tokens and images, and the first
        block's salt, adapter and model state), or None where the prefix cache could not share them (off, prompt logprobs
        wanted, no full block)."""
        if (not self.enable_prefix_caching or request.prompt_logprobs is not None
                or request.num_prompt_tokens <= self.block_size):
            return None
        images = tuple((image.digest, image.start) for image in request.images)
        return hash((self.block_key(request, 0, None), tuple(request.prompt_token_ids), images))

    def block_key(self, request: Request, index: int, parent: BlockHash | None) -> BlockKey:
        """Block `index` of the request: its parent's hash, its tokens (with the images inside it), and (first block
        only) the salt, the
        adapter's registration id (unique, so a re-registered name never reuses its predecessor's K/V) and
        the model's state (model_state.py)."""
        bs = self.block_size
        tokens = tuple(request.token_slice(index * bs, (index + 1) * bs))
        if request.images:  # placeholder tokens alone do not tell one image from another
            tokens += block_images(request.images, index * bs, (index + 1) * bs)
        if index:
            return parent, tokens, None, None, None
        lora = request.lora.id if request.lora is not None else None
        return parent, tokens, request.cache_salt, lora, request.model_state

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block tables to hold `num_new_tokens` more computed tokens; False if full.
        First, each group frees the blocks its spec says no query reads any more. A request of a model with
        state slots (a hybrid's recurrent layers) also takes its slot with its first blocks."""
        if not self.grow_tables(request, num_new_tokens):
            return False
        if self.state_slots is not None and request.state_slot is None:
            request.state_slot = self.state_slots.allocate()
        return True

    def grow_tables(self, request: Request, num_new_tokens: int) -> bool:
        if not self.groups.frees_blocks:
            needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
            if needed <= 0:
                return True
            if not self.pool.can_allocate(needed):
                return False
            request.block_ids.extend(self.pool.allocate(needed))
            return True
        self.ensure_tables(request)
        self.free_unneeded(request)
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        needed = [max(0, total - len(table)) for table in request.block_tables]
        if not self.pool.can_allocate(sum(needed)):
            return False
        for g, count in enumerate(needed):
            if count:
                request.block_tables[g].extend(self.pool.allocate(count, g))
        return True

    def free_unneeded(self, request: Request) -> None:
        """Give back each group's blocks that no query from the request's next token on reads."""
        computed = request.num_computed_tokens
        for g, group in enumerate(self.groups.groups):
            if group.spec.frees_blocks:
                self.free_before(request.block_tables[g], group.spec, computed)

    def free_before(self, table: list[int], spec: LayerSpec, position: int) -> None:
        """Free the blocks of `table` before the first one a query at `position` reads, oldest first, so the pool
        evicts those first: a later prefix hit needs a freeing group's blocks just behind its hit point, never
        its oldest. The scan stops at the first entry already freed, as every one before it is too."""
        first = min(spec.first_needed_block(position, self.block_size), len(table))
        start = first
        while start > 0 and table[start - 1] != self.null_block:
            start -= 1
        if start < first:
            self.pool.free(table[start:first])
            table[start:first] = [self.null_block] * (first - start)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the tail blocks beyond those `num_tokens` need: blocks that held only tokens the request
        discarded (rejected speculative proposals). They were never full of kept tokens, so never cached."""
        keep = self.blocks_needed(num_tokens)
        for table in request.block_tables:
            if len(table) > keep:
                self.pool.free(table[keep:][::-1])
                del table[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so the pool evicts tails before shared heads."""
        for table in request.block_tables:
            self.pool.free([b for b in reversed(table) if b != self.null_block])
        request.block_tables = [[] for _ in request.block_tables]
        request.block_hashes = []
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None

    def blocks_per_group(self) -> list[int]:
        """Blocks in use by each layer group (a block shared by several requests counted once)."""
        return list(self.pool.used_by_group)

    def slots_in_use(self) -> int:
        return (self.pool.num_blocks - self.pool.num_free) * self.block_size
