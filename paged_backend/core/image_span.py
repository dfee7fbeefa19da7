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
    # Its tokens attend to each other both ways (Gemma 3): what is left of it is computed in one step
    # (`chunk_end`), whose attention lets each of its queries see the image's later keys (`widened_spans`).
    whole: bool = False

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


def chunk_end(images: Sequence[ImageSpan], start: int, end: int) -> int:
    """Where a chunk of prefill over [start, end) may end without cutting an image that is computed whole: before
    the first such image it would cut (`start` itself when the chunk starts inside that image and cannot finish it:
    the request waits for a step with room for the rest of the image)."""
    for image in images:
        if image.whole and image.start < end < image.end and start < image.end:
            return image.start if start < image.start else start
    return end


def widened_spans(images: Sequence[ImageSpan], start: int, end: int) -> tuple[tuple[int, int], ...]:
    """The images computed whole among a step's prompt positions [start, end), as (first, last + 1) offsets from
    `end` (the sequence's length after the step): each of their queries sees every key of the image."""
    return tuple((image.start - end, image.end - end) for image in images
                 if image.whole and start < image.end and image.start < end)


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
