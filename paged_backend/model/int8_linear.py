"""Int8 weight-only linear layers on CPU: the LM head of an int4 model (quantization.py).

Each output row is rounded to int8 with its own scale (`max |w| / 127`). Small steps multiply by the
codes through torch's CPU int8 kernel (`_weight_int8pack_mm`, bf16 activations): for the default
model's 49,152 x 576 head on an AVX-512 CPU (2 threads) it measured 2.3 ms at 1 row against 3.9 ms for
the bf16 weight and 3.1 against 4.8 at 4 rows, but 15.3 against 6.7 at 16 rows. So steps of more
than `DENSE_ROWS` rows multiply by a dense bf16 copy of the same dequantized weight, and which path a
step takes changes only rounding (as in int4_linear.py). A step keeps logits for its sampling rows
only, so the head sees one row per decoding sequence: one stream runs on the codes, a batch on the copy.
A compiled forward always uses the copy (a branch on the kept rows would double its graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DENSE_ROWS = 4  # steps of more rows multiply by the dense copy (measured crossover, module docstring)
COMPUTE_DTYPE = torch.bfloat16  # the kernel's activations and scales


class Int8Linear(torch.nn.Module):
    """A linear layer whose weight is int8 with one scale per output row."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`codes [out, in]` int8, `scales [out]`: weight = codes * scales[:, None]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        scales = scales.float().to(COMPUTE_DTYPE)
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("dense", (codes.float() * scales.float()[:, None]).to(COMPUTE_DTYPE))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> Int8Linear:
        """Round `linear`'s weight to int8 per output row (symmetric, scale max |w| / 127)."""
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        # The kernel multiplies by the bf16 scale, so the codes are rounded against that scale.
        scales = scales.to(COMPUTE_DTYPE).float()
        codes = (weight / scales[:, None]).round().clamp(-127, 127)
        return cls(codes, scales, linear.bias)

    def weight_float(self) -> torch.Tensor:
        """The weight this layer multiplies by, `[out, in]` in fp32."""
        return self.dense.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        # A compiled forward always takes the copy: a branch on the kept rows would double its graphs.
        if torch.compiler.is_compiling() or rows.shape[0] > DENSE_ROWS:
            out = F.linear(rows, self.dense)
        else:
            out = torch._weight_int8pack_mm(rows, self.codes, self.scales)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
