"""The exponential race's noise: one Exp(1) number per vocabulary entry of every sampled row.

A row's token is the argmax of p / q with q ~ Exp(1) drawn independently per entry, which samples from p
exactly. Each entry is compared with its own noise, so a seeded row's token depends on its generator and its
probabilities alone, not on the rounding of other entries (a cumulative-sum draw, one uniform per row, moves
with the last bits of every entry before it: a prefix-cache hit or another batch shape then changed a seeded
sample).

The noise is `-log(u)` of uniforms `u` in [0, 1): on the CPU torch's `exponential_` makes about 25 ns a number
(38 ms for 32 rows of a 49,152-token vocabulary on a 2-core EPYC), a uniform and a log about 5 ns together (8
ms); `benchmarks/sampler.py` times the whole draw of 32 rows both ways (2.2x faster unseeded, 3.7x seeded). The
uniforms are fp32 multiples of 2^-24: `u = 0` gives infinite noise, whose entry never wins (p / inf = 0, never a
NaN), so a filtered entry (p = 0) can never be drawn, and the exponential's tail is cut at 16.6, an event of
probability 2^-24 per entry.

A seeded request draws its rows from its own generator, `vocab` uniforms a row (`skip_rows` replays that to
rewind a generator past rows it drew for proposals it did not keep); unseeded rows share torch's default
generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def race_noise(shape: torch.Size, generators: Sequence[torch.Generator | None], drawn: Sequence[bool],
               device: torch.device) -> torch.Tensor:
    """Exp(1) noise `[rows, vocab]` (fp32) for the rows that are `drawn`: row i from `generators[i]` when it has
    one, the other drawn rows from the default generator, in one call. Rows not drawn hold 1 (a greedy row's
    noise, never read) and consume no generator."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    shared = [i for i, (generator, draw) in enumerate(zip(generators, drawn)) if draw and generator is None]
    if len(shared) == shape[0]:
        noise.uniform_()
    elif shared:
        noise[shared] = torch.rand(len(shared), shape[1], device=device)
    for i, (generator, draw) in enumerate(zip(generators, drawn)):
        if draw and generator is not None:
            noise[i].uniform_(generator=generator)
    noise.log_().neg_()
    if not all(drawn):
        noise[[i for i, draw in enumerate(drawn) if not draw]] = 1.0
    return noise


def skip_rows(generator: torch.Generator, rows: int, vocab: int) -> None:
    """Advance `generator` as drawing `rows` noise rows of `vocab` entries from it does."""
    uniforms = torch.empty(vocab, dtype=torch.float32, device=generator.device)
    for _ in range(rows):
        uniforms.uniform_(generator=generator)
