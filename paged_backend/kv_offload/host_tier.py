"""HostTier: KV blocks kept in host memory, least recently used dropped first beyond a byte budget.

Where the pool sits on a GPU, host memory is the cheap place for blocks evicted from it (and for a preempted
request's blocks): reading a block back is one host-to-device copy, against a forward pass over its tokens.
On a CPU the pool is host memory already, so this tier is off by default there (a bigger pool does the same).
"""

from __future__ import annotations

from collections import OrderedDict

from paged_backend.kv_offload.block_file import StoredKey
from paged_backend.kv_offload.block_rows import BlockRows


class HostTier:
    name = "host"

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.blocks: OrderedDict[tuple[int, int], tuple[StoredKey, BlockRows]] = OrderedDict()
        self.nbytes = 0
        self.saved = 0
        self.dropped = 0  # blocks larger than the whole budget

    def holds(self, key: StoredKey) -> bool:
        return (key.group, key.block_hash) in self.blocks

    def save(self, key: StoredKey, rows: BlockRows) -> None:
        if rows.nbytes > self.budget:
            self.dropped += 1
            return
        name = (key.group, key.block_hash)
        if name in self.blocks:
            self.blocks.move_to_end(name)
            return
        while self.nbytes + rows.nbytes > self.budget:
            _, (_, old) = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
        self.blocks[name] = (key, rows)
        self.nbytes += rows.nbytes
        self.saved += 1

    def load(self, key: StoredKey) -> BlockRows | None:
        """The block stored under `key`'s hash if its whole key matches (a hash collision never serves it)."""
        entry = self.blocks.get((key.group, key.block_hash))
        if entry is None or entry[0] != key:
            return None
        self.blocks.move_to_end((key.group, key.block_hash))
        entry[1].wait()
        return entry[1]

    def flush(self) -> None:
        """Nothing is in flight in memory (copies off a GPU complete when loaded)."""

    def stats(self) -> dict[str, float]:
        return {"blocks": len(self.blocks), "bytes": self.nbytes, "budget_bytes": self.budget,
                "saved_blocks": self.saved, "dropped_blocks": self.dropped}
