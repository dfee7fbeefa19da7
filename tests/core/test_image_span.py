"""ImageSpan's arithmetic: where a chunk may end, which spans a step widens, what a block's key adds, M-RoPE
positions past the prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_backend.core.image_span import ImageSpan, RopePositions, block_images, chunk_end, widened_spans


def span(start: int, end: int, whole: bool = True, digest: int = 7) -> ImageSpan:
    return ImageSpan(np.arange(start, end), digest, {"pixel_values": torch.zeros(1)}, whole)


@pytest.mark.parametrize(("start", "end", "expected"), [
    (0, 5, 5),     # before the image
    (0, 12, 10),   # would cut it: ends before it
    (0, 20, 20),   # takes all of it
    (10, 14, 10),  # starts at it, cannot finish it: nothing this step
    (12, 15, 12),  # starts inside it (a prefix hit), cannot finish it: nothing
    (12, 20, 20),  # starts inside it and finishes it
    (20, 30, 30),  # after it
])
def test_a_chunk_never_cuts_an_image_computed_whole(start: int, end: int, expected: int) -> None:
    assert chunk_end([span(10, 20)], start, end) == expected


def test_an_image_of_one_way_tokens_may_be_cut() -> None:
    assert chunk_end([span(10, 20, whole=False)], 0, 12) == 12


def test_widened_spans_are_offsets_from_the_end_of_the_step() -> None:
    images = [span(2, 6), span(10, 20), span(30, 34, whole=False)]
    assert widened_spans(images, 0, 20) == ((-18, -14), (-10, 0))
    assert widened_spans(images, 12, 22) == ((-12, -2),)  # a prefix hit inside the second image
    assert widened_spans(images, 20, 40) == ()


def test_a_block_key_carries_the_digest_of_each_image_inside_it() -> None:
    digest = 2**127 + 5
    image = span(4, 12, digest=digest)
    assert block_images([image], 0, 4) == ()
    low, high = block_images([image], 8, 12)[:2]
    assert (low + 2**63) + ((high + 2**63) << 64) == digest
    assert block_images([image], 8, 12)[2] == 4  # the block starts 4 tokens into the image
    assert block_images([image], 0, 8) != block_images([span(4, 12, digest=digest + 1)], 0, 8)


def test_rope_positions_past_the_prompt_add_the_delta_on_every_axis() -> None:
    prompt = np.array([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 3, 4, 5]])
    rope = RopePositions(prompt, delta=-2)
    assert rope.between(4, 8).tolist() == [[2, 5, 4, 5], [3, 5, 4, 5], [4, 5, 4, 5]]
