"""EncoderCache: the vision encoder's output per image, kept by the image's digest, so a repeated image is not
encoded again: by a request that sends it again, a preempted one recomputing its prompt, or a prefill whose
chunks cut through it.

It is bounded in bytes and evicts the least recently used image. An evicted image is encoded again when a request
still needs it (its `ImageSpan` keeps the encoder's inputs), so the bound costs time, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_BYTES = 256 * 2**20  # a few hundred images of a few hundred fp32 rows of a 4k-wide model


@dataclass
class EncoderStats:
    images_encoded: int = 0
    hits: int = 0  # images a step needed and found here
    encoder_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """What `Engine.stats()` reports of the vision encoder."""
        return {"images_encoded": self.images_encoded, "encoder_cache_hits": self.hits,
                "encoder_seconds": self.encoder_seconds}


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()  # digest -> [tokens, hidden]
        self.bytes = 0
        self.stats = EncoderStats()

    def get(self, digest: int) -> torch.Tensor | None:
        embeds = self.entries.get(digest)
        if embeds is not None:
            self.entries.move_to_end(digest)
            self.stats.hits += 1
        return embeds

    def put(self, digest: int, embeds: torch.Tensor) -> None:
        """Keep `embeds`, evicting the least recently used images past the bound (one image larger than the
        bound is used by its step and not kept)."""
        size = embeds.numel() * embeds.element_size()
        if digest in self.entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self.entries[digest] = embeds
        self.bytes += size

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)
