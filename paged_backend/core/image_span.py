"""ImageSpan: where one image of a prompt sits among its tokens, and what identifies it.

A vision-language prompt carries its images as placeholder tokens (the processor expands each image to as
many placeholders as the vision encoder gives it embeddings). A request keeps one span per image: the prompt
positions of its placeholders, the hash of what the encoder reads, and those encoder inputs themselves, so a
preempted request can recompute its prompt and a chunk of prefill that cuts through an image finds the rows it
needs. The prefix cache keys a block by the images it holds (`block_images`): equal placeholder tokens with
another image are other K/V.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class ImageSpan:
    positions: np.ndarray  # int64, ascending: the prompt positions its embedding rows go to, in row order
    digest: int  # 128-bit hash of `inputs`: equal digests, equal embeddings
    inputs: Mapping[str, torch.Tensor]  # what the model's vision encoder takes for this image alone

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def end(self) -> int:
        """One past its last placeholder."""
        return int(self.positions[-1]) + 1

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def rows_between(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(its embedding rows, their prompt positions) that fall in [start, end)."""
        first, last = np.searchsorted(self.positions, (start, end))
        return np.arange(first, last), self.positions[first:last]


@dataclass(frozen=True, eq=False)
class RopePositions:
    """A prompt's multi-axis rotary positions (Qwen2-VL's M-RoPE: time, height, width): each prompt token's three
    positions, and after the prompt one position on every axis, the sequence index plus `delta` (negative after an
    image, whose tokens advance the positions by less than their count)."""

    prompt: np.ndarray  # int64 [3, prompt tokens]
    delta: int

    def between(self, start: int, end: int) -> np.ndarray:
        """The positions `[3, end - start]` of sequence indices [start, end)."""
        index = np.arange(start, end)
        inside = index < self.prompt.shape[1]
        out = np.broadcast_to(index + self.delta, (3, len(index))).copy()
        out[:, inside] = self.prompt[:, index[inside]]
        return out


def block_images(images: Sequence[ImageSpan], start: int, end: int) -> tuple[int, ...]:
    """What a prefix-cache block over prompt positions [start, end) adds to its key for the images inside it: each
    image's digest, as two signed 64-bit halves, and how far into the image the block starts. Empty for a block
    without an image, so text blocks keep the keys they had."""
    extra: list[int] = []
    for image in images:
        if image.start < end and start < image.end:
            low, high = image.digest & (2**64 - 1), image.digest >> 64
            extra += [low - 2**63, high - 2**63, start - image.start]
    return tuple(extra)
