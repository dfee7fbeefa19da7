"""Ways to cut a text into streamed pieces: whole, a character at a time, and seeded random lengths."""

from __future__ import annotations

import random


def chunkings(text: str, seeds: int = 4, longest: int = 9) -> list[list[str]]:
    """`text` whole, by characters, and in `seeds` random cuts of 1..`longest` characters each."""
    ways = [[text], list(text)]
    for seed in range(seeds):
        rng, pieces, at = random.Random(seed), [], 0
        while at < len(text):
            step = rng.randint(1, longest)
            pieces.append(text[at:at + step])
            at += step
        ways.append(pieces)
    return ways
