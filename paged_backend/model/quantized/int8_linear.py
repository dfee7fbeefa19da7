"""Int8 weight-only linear layers on CPU: the LM head of an int4 model (quantization.py).

Each output row is rounded to int8 with its own scale (`max |w| / 127`). Small steps multiply by the
codes: through the compiled CPU kernel (kernels/cpu_int8_matmul.py) where it is built, else through
torch's CPU int8 kernel (`_weight_int8pack_mm`, bf16 activations). On the default model's head torch's
kernel beats the bf16 weight at a few rows and falls well behind it by 16, and the compiled kernel is
faster still at one row (docs/precision.md has the measurements). So steps of more than
`DENSE_ROWS[torch.bfloat16]` rows multiply by a dense bf16 copy of the same dequantized weight
(quantized_linear.py). On a CPU without native bf16 the copy is fp32, and the compiled kernel beats it up
to `DENSE_ROWS[torch.float32]` rows (23 ms against 38 ms at 32 rows; past 40 rows the copy is ahead).
A step keeps logits for its sampling rows only, so the head sees one row per decoding sequence: one stream
and small batches run on the codes, larger batches on the copy.
A compiled forward calls the choice as one registered custom op (`paged_backend::int8_matmul`), which
takes it at run time: a branch on the kept rows inside the graph would double its graphs, and always
taking the copy made a compiled one-stream step's head slower.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import cpu_int8_matmul
from paged_backend.model.quantized.quantized_linear import (
    COMPUTE_DTYPE,
    QuantizedLinear,
    cast_to,
    dense_matmul,
)

# Steps of more rows multiply by the dense copy, by the copy's dtype (measured crossovers: docs/precision.md).
DENSE_ROWS = {torch.bfloat16: 4, torch.float32: 32}
# The same for bf16 rows where the tiled kernel runs (AVX512-BF16): it kept ahead of the dense copy to 64 rows.
TILED_DENSE_ROWS = 48


class Int8Linear(QuantizedLinear):
    """A linear layer whose weight is int8 with one scale per output row."""

    dense_rows_by_dtype = DENSE_ROWS

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 dense_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        """`codes [out, in]` int8, `scales [out]`: weight = codes * scales[:, None]. `dense_dtype`: the model's
        dtype, that of the dense copy large steps multiply by."""
        scales = scales.float().to(COMPUTE_DTYPE)
        super().__init__(codes.float() * scales.float()[:, None], bias, dense_dtype)
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("row_norms", self.dense.float().norm(dim=1))  # for int8_matmul's error bound
        # The codes tiled for the several-rows kernel, where it runs (not saved: tiled again at load).
        self.register_buffer("tiled_codes", cpu_int8_matmul.tiled_here(self.codes), persistent=False)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> Int8Linear:
        """Round `linear`'s weight to int8 per output row (symmetric, scale max |w| / 127)."""
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        # The kernel multiplies by the bf16 scale, so the codes are rounded against that scale.
        scales = scales.to(COMPUTE_DTYPE).float()
        codes = (weight / scales[:, None]).round().clamp(-127, 127)
        return cls(codes, scales, linear.bias, linear.weight.dtype)

    def uses_dense(self, rows: torch.Tensor) -> bool:
        return False  # int8_matmul() makes the choice, at run time in a compiled graph (module docstring)

    def quantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        # The registered op inside a graph being compiled; its implementation directly in an eager forward,
        # which skips the dispatcher (as custom_ops.paged_attention does).
        matmul = int8_matmul_op if torch.compiler.is_compiling() else int8_matmul
        return matmul(rows, self.codes, self.scales, self.dense, self.row_norms, self.tiled_codes)


def int8_matmul(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor,
                row_norms: torch.Tensor, tiled: torch.Tensor | None = None) -> torch.Tensor:
    """`rows [n, in]` times the weight `codes * scales[:, None]`, in the dtype of `rows`: through an int8
    kernel for up to DENSE_ROWS rows of the dense copy's dtype (the compiled CPU kernel,
    kernels/cpu_int8_matmul.py, where it is built; else torch's, on rows rounded to bf16), else through the
    copy `dense [out, in]`.
    fp32 rows through torch's kernel get the outputs that could be their row's largest recomputed in fp32
    (refine_near_max, with `row_norms [out]`, the copy's row norms); the compiled kernel's fp32 sums need no
    such pass, which cost 15 ms of a 32-row head on an AVX2 CPU (the sums 23). With the codes `tiled` (where the tiled
    kernel runs), bf16 rows up to TILED_DENSE_ROWS go through it."""
    if tiled is not None and rows.shape[0] <= TILED_DENSE_ROWS and cpu_int8_matmul.serves_tiled(rows):
        return cast_to(cpu_int8_matmul.int8_matmul_tiled(rows, tiled, scales), rows.dtype)
    if rows.shape[0] > DENSE_ROWS[dense.dtype]:
        return dense_matmul(rows, dense)
    if cpu_int8_matmul.serves(rows, codes, scales):
        # fp32 sums of the rows as given, as the dense copy makes them (in another order): nothing to refine.
        return cast_to(cpu_int8_matmul.int8_matmul(rows, codes, scales), rows.dtype)
    out = cast_to(torch._weight_int8pack_mm(cast_to(rows, COMPUTE_DTYPE), codes, scales), rows.dtype)
    if rows.dtype == torch.float32 and dense.dtype == torch.float32:
        out = refine_near_max(rows, out, dense, error_bound(rows, out, row_norms))
    return out


# torch's kernel rounds its rows to bf16 and its outputs too: a logit near 25 comes back in steps of 0.125, so
# a greedy choice between two tokens whose fp32 logits differ by less is a coin toss (the default model's
# first token for "What is the capital of France?" is one: 0.08 apart, and the kernel alone answered with
# the other). Only the outputs whose error bound reaches the row's largest lower bound can be its true
# largest: recomputed in fp32 from the dense copy (1-7 of the 49,152 per row in a sample of the default
# model's steps), the row's argmax is the dense path's.
def error_bound(rows: torch.Tensor, out: torch.Tensor, row_norms: torch.Tensor) -> torch.Tensor:
    """`[n, out]`: how far each of the kernel's outputs can be from the fp32 product. Rows rounded to bf16
    move by at most 2^-9 of their norm, so a product by at most that times the weight row's norm (Cauchy-
    Schwarz), and rounding the output moves it by at most 2^-9 of its size. Doubled, for the kernel's own
    roundings (measured: the actual error stayed within the undoubled bound)."""
    return 2.0**-8 * (rows.norm(dim=-1, keepdim=True) * row_norms + out.abs())


def refine_near_max(rows: torch.Tensor, out: torch.Tensor, dense: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`out [n, out]` with every entry that may be its row's largest, given each entry's `bound [n, out]`,
    recomputed as the fp32 product of `rows [n, in]` and that row of `dense [out, in]`."""
    near = out + bound >= (out - bound).amax(-1, keepdim=True)
    row, col = near.nonzero(as_tuple=True)
    out[row, col] = (rows[row] * dense[col]).sum(-1)
    return out


int8_matmul_op = torch.library.custom_op("paged_backend::int8_matmul", int8_matmul, mutates_args=())


@int8_matmul_op.register_fake
def _(rows, codes, scales, dense, row_norms, tiled=None):
    return rows.new_empty(rows.shape[0], codes.shape[0])
