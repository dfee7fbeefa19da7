"""Drawing one token per row from a batch of distributions: the inverse of each row's cumulative distribution at
one uniform number, found by blocks.

Each row costs one uniform, a sum per block of DRAW_BLOCK probabilities and a cumulative sum over one block. The
exponential race (argmax of p / q, q ~ Exp(1), which `torch.multinomial` also runs) needs a random number per
vocabulary entry instead: on CPU torch draws those at about 25 ns each, 37 ms for 32 rows of a 49,152-token
vocabulary against 0.9 ms here (2 threads of an AMD EPYC; docs/design.md has the measurement), which was a
third of a sampled 32-row decode step of the default model.

Exactness: the block sums are fp32 sums of 1,024 probabilities; the choice of a block and of a token in it is
made in fp64, so a cumulative value near 1 keeps the mass of a token of probability 1e-12 (fp32 cumulative sums
would round a token below 6e-8 away near the end of the vocabulary). A token of probability 0 is never drawn.
A seeded request draws its uniform from its own generator (`uniforms`), one fp64 number per sampled token, so
its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

DRAW_BLOCK = 1024  # vocabulary entries per block


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """`[len(generators)]` fp64 numbers uniform in [0, 1): row i's from `generators[i]` where it is not None (one
    draw of `torch.rand(1, dtype=torch.float64)`, which `advance` repeats), else from torch's default generator."""
    values = torch.rand(len(generators), dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            values[i] = torch.rand(1, dtype=torch.float64, generator=generator, device=device)[0]
    return values


def advance(generator: torch.Generator, draws: int) -> None:
    """Move `generator` on by `draws` sampled tokens, as `uniforms` would have drawn for them."""
    for _ in range(draws):
        torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`[B]` token ids: row i's the first token whose cumulative probability in `probs [B, V]` (non-negative, not
    necessarily normalised) exceeds `uniform[i]` times the row's total."""
    rows, vocab = probs.shape
    sums = block_sums(probs)
    ends = sums.cumsum(-1)
    target = uniform.to(ends)[:, None] * ends[:, -1:]
    # A target rounded up to a block's end would pick the next block, which may be empty: the last with mass then.
    block = torch.minimum(torch.searchsorted(ends, target, right=True), last_positive(sums))
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_min(0)), 0.0)
    offsets = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)
    local = torch.where(offsets < vocab, probs.gather(1, offsets.clamp_max(vocab - 1)), 0.0).to(ends)
    # The block's fp32 sum and its fp64 cumulative sum may differ in the last bits: past the block's end, the
    # block's last token with mass.
    token = torch.minimum(torch.searchsorted(local.cumsum(-1), target - before, right=True), last_positive(local))
    return (block * DRAW_BLOCK + token)[:, 0]


def block_sums(probs: torch.Tensor) -> torch.Tensor:
    """`[B, ceil(V / DRAW_BLOCK)]` fp64: each block's sum (in fp32, as torch vectorises it)."""
    rows, vocab = probs.shape
    whole = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = probs[:, :whole].reshape(rows, -1, DRAW_BLOCK).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], 1)
    return sums.double()


def last_positive(values: torch.Tensor) -> torch.Tensor:
    """`[B, 1]`: the index of each row's last positive entry (its last entry where none is)."""
    width = values.shape[-1]
    return width - 1 - (values > 0).flip(-1).int().argmax(-1, keepdim=True)
