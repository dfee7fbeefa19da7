"""PrefixTable: which replica was last sent each block-aligned prompt prefix.

It is the router's picture of the replicas' prefix caches, kept on the client: prompts are cut into
blocks of the engines' block size and each block is keyed by a hash chained over every block
before it (as the engines key their cached blocks), so a key stands for a whole prefix. A salt
(a LoRA adapter's registration) starts the chain, as the adapter enters an engine's first block
hash: the same tokens under another adapter are another prefix. The picture
is approximate (a replica may have evicted a block since); it only steers routing, never results.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class PrefixTable:
    def __init__(self, block_size: int = 16, capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity = capacity  # prefix blocks remembered, least recently routed dropped first
        self.owners: OrderedDict[int, int] = OrderedDict()

    def match(self, token_ids: Sequence[int], salt: str | None = None) -> tuple[int | None, int]:
        """(replica holding the longest known prefix of these tokens, its length in tokens)."""
        owner, matched = None, 0
        for depth, key in enumerate(self.block_keys(token_ids, salt), start=1):
            if key not in self.owners:
                break
            owner, matched = self.owners[key], depth * self.block_size
        return owner, matched

    def record(self, token_ids: Sequence[int], replica: int, salt: str | None = None) -> None:
        for key in self.block_keys(token_ids, salt):
            self.owners[key] = replica
            self.owners.move_to_end(key)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)

    def forget(self, replica: int) -> None:
        for key in [k for k, owner in self.owners.items() if owner == replica]:
            del self.owners[key]

    def block_keys(self, token_ids: Sequence[int], salt: str | None = None) -> Iterator[int]:
        key = 0 if salt is None else hash(salt)
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            key = hash((key, tuple(token_ids[start:start + self.block_size])))
            yield key
