"""token_draw: the inverse cumulative distribution by blocks, against an fp64 reference, and its seeded uniforms."""

from __future__ import annotations

import pytest
import torch

from paged_backend.sampling.token_draw import DRAW_BLOCK, advance, draw, uniforms


def reference(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's fp64 cumulative distribution at `uniform` times the row's total."""
    ends = probs.double().cumsum(-1)
    return torch.searchsorted(ends, (uniform.double() * ends[:, -1])[:, None], right=True)[:, 0]


@pytest.mark.parametrize("vocab", [DRAW_BLOCK * 3, DRAW_BLOCK * 2 + 300, DRAW_BLOCK - 1, 49_152])
def test_draw_is_the_inverse_of_the_cumulative_distribution(vocab: int):
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=generator) * 3, -1)
    probs[:, 7] = 0.0  # banned tokens (top-k, a grammar) have no mass
    probs[::2] *= 3.0  # rows need not be normalised (rejection sampling's residual is not)
    uniform = torch.rand(64, dtype=torch.float64, generator=generator)
    # (The fp32 block sums could move a block's edge by a rounding, for a uniform within 1e-7 of it: not these.)
    assert torch.equal(draw(probs, uniform), reference(probs, uniform))


def test_a_token_far_below_fp32_spacing_keeps_its_mass():
    """Near the end of the vocabulary cumulative sums are near 1, where fp32 values are 6e-8 apart: a token of
    probability 1e-10 there would get no interval of its own. In fp64 it keeps it."""
    vocab = 3 * DRAW_BLOCK
    probs = torch.zeros(1, vocab)
    probs[0, 10] = 1.0
    probs[0, vocab - 2] = 1e-10
    inside = torch.tensor([1.0 - 0.5e-10], dtype=torch.float64)  # within the tiny token's interval
    assert draw(probs, inside).item() == vocab - 2
    assert draw(probs, torch.tensor([0.999], dtype=torch.float64)).item() == 10


def test_edges_of_the_unit_interval_draw_tokens_with_mass():
    vocab = 2 * DRAW_BLOCK + 5
    probs = torch.zeros(2, vocab)
    probs[:, [3, DRAW_BLOCK + 1]] = 0.5  # the first and last tokens and the whole last block have no mass
    edges = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    assert draw(probs, edges).tolist() == [3, DRAW_BLOCK + 1]


def test_a_block_sum_rounded_up_still_draws_inside_the_block():
    """1,024 entries of 0.1 sum to 102.4000153 in fp32 and to 102.3999939 in fp64: a uniform near 1 lands past
    the block's fp64 end, and must still draw the block's last token, not the next (empty) block's first."""
    probs = torch.zeros(1, DRAW_BLOCK + 10)
    probs[0, :DRAW_BLOCK] = 0.1
    assert draw(probs, torch.tensor([1.0 - 1e-9], dtype=torch.float64)).item() == DRAW_BLOCK - 1


def test_draws_follow_the_distribution():
    """100,000 draws from one row of three blocks: every token's count within 5 standard errors."""
    generator = torch.Generator().manual_seed(0)
    vocab, n, chunk = 2 * DRAW_BLOCK + 300, 100_000, 20_000
    probs = torch.softmax(torch.randn(vocab, generator=generator) * 2, -1)
    counts = sum(torch.bincount(draw(probs.expand(chunk, vocab), torch.rand(chunk, dtype=torch.float64,
                                                                            generator=generator)), minlength=vocab)
                 for _ in range(n // chunk)).double()
    expected = probs.double() * n
    assert ((counts - expected).abs() <= 5 * expected.sqrt() + 1).all()


def test_seeded_rows_draw_from_their_own_generator():
    seeded = [torch.Generator().manual_seed(s) for s in (1, 2)]
    first = uniforms([seeded[0], None, seeded[1]], torch.device("cpu"))
    alone = uniforms([torch.Generator().manual_seed(2)], torch.device("cpu"))
    assert first[2] == alone[0]  # what else is in the batch does not matter
    assert first[0] == torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))[0]


def test_advance_skips_what_the_draws_would_have_taken():
    drawn, skipped = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        uniforms([drawn], torch.device("cpu"))
    advance(skipped, 3)
    assert torch.equal(uniforms([drawn], torch.device("cpu")), uniforms([skipped], torch.device("cpu")))
