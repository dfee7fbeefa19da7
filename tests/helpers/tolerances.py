"""How close two computations of the same numbers must be, from the dtype and the operation.

The engine and HF compute one model by different kernels: paged attention against dense attention, a
packed row of many sequences against one sequence, a padded decode step, a multi-token verification
forward against one-token steps. Each matmul, norm and softmax then adds the same terms in another order,
and the order also changes with the CPU: oneDNN and MKL block their sums by the SIMD width, so an AVX2 and an
AVX-512 machine round the same forward differently. A reordered fp32 sum moves its result by a few units in
the last place (ulps) of its partial sums, and a forward stacks a few dozen such sums between the input and a
logit. So every comparison between two paths states its tolerance in ulps of fp32 sized by what the
operation stacks (the sums run in fp32 on both paths, whatever the model's dtype), plus the rounding of each
side's result to the compared dtype: never a bare number that happened to hold on one machine (1e-5 held on
one CPU and failed by 1.07e-5 on another).

A real fault (a wrong mask, position, scale or cache slot) moves logits by 1e-2 and more, far outside these
bounds, which is what keeps the comparisons meaningful.
"""

from __future__ import annotations

import pytest
import torch

# ulps of fp32 that two orders of the same sums may differ by, per operation:
ACCUMULATED_ULPS = {
    "kernel": 256,  # one attention or linear layer: reductions over at most a few hundred terms
    "forward": 2048,  # a whole forward's logits or log-probabilities: a few layers of such reductions, compounding
}


def tolerance(dtype: torch.dtype, operation: str) -> dict[str, float]:
    """`rtol` and `atol` for `torch.testing.assert_close` when the same `operation` ("kernel" or "forward") is
    computed along two paths and compared in `dtype`."""
    accumulated = ACCUMULATED_ULPS[operation] * torch.finfo(torch.float32).eps
    # A bf16/fp16 result is rounded once on each side: two ulps of that dtype apart at most.
    rounded = 0.0 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    bound = accumulated + rounded
    return {"rtol": bound, "atol": bound}


def approx(expected, dtype: torch.dtype = torch.float32, operation: str = "forward"):
    """`pytest.approx(expected)` with `tolerance(dtype, operation)`, for lists of floats (log-probabilities)."""
    bound = tolerance(dtype, operation)
    return pytest.approx(expected, rel=bound["rtol"], abs=bound["atol"])
