"""A marker found in an answer by its token ids, as the model wrote them (the thinking budget, the usage count)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def marker_ids(tokenizer: Any, marker: str) -> list[int]:
    return list(tokenizer.encode(marker, add_special_tokens=False))


def find(ids: Sequence[int], pattern: list[int], start: int = 0) -> int:
    """Index of the first occurrence of `pattern` in `ids` at or after `start`, or -1."""
    first = pattern[0]
    while True:
        try:
            at = ids.index(first, start)
        except ValueError:
            return -1
        if list(ids[at:at + len(pattern)]) == pattern:
            return at
        start = at + 1
