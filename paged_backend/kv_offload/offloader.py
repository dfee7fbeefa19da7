"""KVOffloader: moves full KV blocks between the pool's pages and the second tier behind it.

The tier sits under the prefix cache (core/kv_cache_manager.py), keyed like it by the block's chain hash:
- Every full block that the prefix cache registers is also stored (write-through): its rows are copied off the
  pool in the step that filled it, and each tier keeps them within its budget (host_tier.py, disk_tier.py). So a
  block the pool evicts later is still in the tier, and on disk a prefix outlives a restart or a killed process.
- A request admitted with nothing computed first brings back, into free pages registered in the pool's prefix
  cache, the blocks of its prefix the pool lacks and a tier holds; the prefix cache then hands them out as hits.
- Preemption: a preempted request's full blocks are already stored, so resuming it reads them back (swap) instead
  of recomputing them, when `preemption_mode` says so (`swaps`). Under "auto" a pool on a CPU swaps: there,
  reading a block back costs a small fraction of computing its tokens (docs/kv-offload.md has the measurement).
  A pool on a GPU recomputes: a batched prefill there is fast enough that a read over PCIe, let alone from disk,
  need not win, and that was not measured.

Only the model state it fingerprinted at start-up is served (fingerprint.py): blocks computed after the weights
or the model's adapters change, or under a per-request LoRA adapter (whose ids are this process's own), are
neither stored nor read; they use the pool alone, as without a tier.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from paged_backend.cache_folder import cache_dir
from paged_backend.core.block_pool import BlockHash, BlockKey
from paged_backend.core.kv_cache_groups import CacheGroups
from paged_backend.core.request import Request
from paged_backend.kv_offload.block_file import StoredKey
from paged_backend.kv_offload.block_rows import BlockRows
from paged_backend.kv_offload.disk_tier import DiskTier
from paged_backend.kv_offload.fingerprint import model_fingerprint
from paged_backend.kv_offload.host_tier import HostTier
from paged_backend.model.paged.paged_cache import KVShape, PagedCache


class KVOffloader:
    def __init__(self, cache: PagedCache, tiers: list[HostTier | DiskTier], fingerprint: str, model_state: int,
                 preemption_mode: str = "auto") -> None:
        self.kv, self.kv_scales, self.block_size = cache.kv, cache.kv_scales, cache.block_size
        self.on_cpu = cache.kv.device.type == "cpu"
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.model_state = model_state
        self.preemption_mode = preemption_mode
        self.restored = {tier.name: 0 for tier in tiers}  # blocks read back, per tier
        self.restore_seconds = 0.0
        self.save_seconds = 0.0  # the step's share of storing: copying rows off the pool
        self.swapped_in = 0  # blocks read back for preempted requests
        self.swap_seconds = 0.0  # the part of restore_seconds spent on them

    def serves(self, request: Request) -> bool:
        """Whether the request's blocks may be stored and read back: under the fingerprinted state, no LoRA."""
        return request.lora is None and request.model_state == self.model_state

    def swaps(self, request: Request) -> bool:
        """Whether a request being preempted now will read its blocks back when it resumes (else recompute)."""
        if self.preemption_mode == "auto":
            return self.on_cpu
        return self.preemption_mode == "swap"

    def stored_key(self, key: BlockKey, block_hash: BlockHash, group: int) -> StoredKey:
        parent, tokens, salt, _, _ = key
        return StoredKey(self.fingerprint, group, block_hash, parent, tokens, salt)

    def save(self, key: BlockKey, block_hash: BlockHash, pages: list[int]) -> None:
        """Store one full block (`pages`: its page in each layer group) in every tier that lacks it."""
        start = time.perf_counter()
        for group, page in enumerate(pages):
            stored = self.stored_key(key, block_hash, group)
            lacking = [tier for tier in self.tiers if not tier.holds(stored)]
            if lacking:
                rows = self.copy_out(page)
                for tier in lacking:
                    tier.save(stored, rows)
        self.save_seconds += time.perf_counter() - start

    def load(self, key: BlockKey, block_hash: BlockHash, group: int, page: int, swap: bool) -> bool:
        """Fill `page` with the block from the first tier holding it; whether one did."""
        start = time.perf_counter()
        stored = self.stored_key(key, block_hash, group)
        rows = None
        for tier in self.tiers:
            rows = tier.load(stored)
            if rows is not None:
                self.copy_in(page, rows)
                self.restored[tier.name] += 1
                self.swapped_in += swap
                break
        seconds = time.perf_counter() - start
        self.restore_seconds += seconds
        self.swap_seconds += seconds if swap else 0.0
        return rows is not None

    def copy_out(self, page: int) -> BlockRows:
        """A copy of one page's rows on the host (in flight from a GPU: BlockRows.wait)."""
        slots = slice(page * self.block_size, (page + 1) * self.block_size)
        rows = self.kv[:, :, :, slots]
        scales = None if self.kv_scales is None else self.kv_scales[:, :, :, slots]
        if rows.device.type == "cpu":  # clone: a contiguous view would otherwise alias the pool
            return BlockRows(rows.clone(memory_format=torch.contiguous_format),
                             None if scales is None else scales.clone(memory_format=torch.contiguous_format))
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        host_scales = None
        if scales is not None:
            host_scales = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
            host_scales.copy_(scales, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return BlockRows(host, host_scales, ready)

    def copy_in(self, page: int, rows: BlockRows) -> None:
        slots = slice(page * self.block_size, (page + 1) * self.block_size)
        self.kv[:, :, :, slots].copy_(rows.rows)
        if self.kv_scales is not None:
            self.kv_scales[:, :, :, slots].copy_(rows.scales)

    def flush(self) -> None:
        """Wait until every tier has stored what it was given (a benchmark's or a test's restart)."""
        for tier in self.tiers:
            tier.flush()

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = {"kv_offload_restore_seconds": self.restore_seconds,
                                   "kv_offload_save_seconds": self.save_seconds,
                                   "kv_offload_swapped_in_blocks": self.swapped_in,
                                   "kv_offload_swap_seconds": self.swap_seconds}
        for tier in self.tiers:
            for name, value in tier.stats().items():
                stats[f"kv_offload_{tier.name}_{name}"] = value
            stats[f"kv_offload_{tier.name}_hit_blocks"] = self.restored[tier.name]
        return stats


def make_offloader(config, model: torch.nn.Module, shape: KVShape, groups: CacheGroups, cache: PagedCache,
                   model_state: int) -> KVOffloader | None:
    """The engine's second tier as `config` asks (None: no tier)."""
    if not config.kv_offload_host_bytes and not config.kv_offload_disk_bytes:
        return None
    fingerprint = model_fingerprint(model, shape, groups, cache.kv.dtype, cache.block_size)
    tiers: list[HostTier | DiskTier] = []
    if config.kv_offload_host_bytes:
        tiers.append(HostTier(config.kv_offload_host_bytes))
    if config.kv_offload_disk_bytes:
        root = Path(config.kv_offload_dir) if config.kv_offload_dir else cache_dir() / "kv"
        page = cache.kv[:, :, :, :cache.block_size]
        scale_shape = None if cache.kv_scales is None else tuple(cache.kv_scales[:, :, :, :cache.block_size].shape)
        tiers.append(DiskTier(root / fingerprint, config.kv_offload_disk_bytes, cache.kv.dtype, tuple(page.shape),
                              scale_shape))
    return KVOffloader(cache, tiers, fingerprint, model_state, config.preemption_mode)
