"""Int4 weight-only linear layers on CPU: `LLM(..., quantization="int4")`.

A weight is stored as 4-bit codes in groups of 32 along the input dimension, each group with its own
scale and offset: `w = q * d + m` for codes `q` in 0..15. That is the layout of llama.cpp's Q4_1 (the
default model's own GGUF tensors), so those load as they are (gguf_int4.py); any other float weight
is rounded to it (`from_float`: `m` the group's minimum, `d` its range / 15).

Small steps multiply by the codes through torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
bf16 activations): on an AVX-512 CPU (2 threads, the default model's 30 layers of linears) it measured
4.0 ms at 1 row against 18.8 ms for bf16 and 36.5 ms for fp32 weights, 11.9 against 25.1 at 8 rows,
and even at 32 rows. Past that the kernel falls behind a dense bf16 matmul (101 against 75 ms at 64
rows, 654 against 296 at 512), so steps of more than `DENSE_ROWS` rows multiply by a dense bf16 copy
of the same dequantized weights instead. Both paths compute with the int4 model's weights (the copy
is dequantized from the codes, not kept from the original), so which path a step takes changes only
rounding, as any change of matmul kernel does. The copy costs 2 bytes per weight: on CPU this format
buys decode speed, not memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP_SIZE = 32  # weights per (scale, offset) pair along the input dimension, as in GGUF's Q4_1
DENSE_ROWS = 32  # steps of more rows multiply by the dense copy (measured crossover, module docstring)
COMPUTE_DTYPE = torch.bfloat16  # the int4 kernel's fast path takes bf16 activations (fp32 was 25x slower)


def can_quantize(linear: torch.nn.Linear) -> bool:
    """The kernel's shape rules: output features a multiple of 16, input features of the group size."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP_SIZE == 0


def has_int4_layers(model: torch.nn.Module) -> bool:
    return any(isinstance(module, Int4Linear) for module in model.modules())


class Int4Linear(torch.nn.Module):
    """A linear layer whose weight is 4-bit codes with a scale and offset per group of 32 inputs."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        """`codes [out, in]` in 0..15, `scales` and `offsets [out, in / 32]`: weight = codes * scales + offsets."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.out_features % 16 or self.in_features % GROUP_SIZE:
            raise ValueError(f"int4 weights need out_features % 16 == 0 and in_features % {GROUP_SIZE} == 0, "
                             f"got {self.out_features} x {self.in_features}")
        # The kernel dequantizes as (code - 8) * scale + zero, with scale and zero in the activations' dtype.
        scale = scales.float().to(COMPUTE_DTYPE)
        zero = (offsets.float() + 8 * scales.float()).to(COMPUTE_DTYPE)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())
        self.register_buffer("dense", dequantize(codes, scale, zero).to(COMPUTE_DTYPE))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> Int4Linear:
        """Round `linear`'s weight to int4 per group of 32: offset the group's minimum, scale its range / 15."""
        weight = linear.weight.detach().float()
        groups = weight.view(weight.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).view_as(weight)
        return cls(codes, scales, low, linear.bias)

    def weight_float(self) -> torch.Tensor:
        """The weight this layer multiplies by, `[out, in]` in fp32."""
        return self.dense.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if rows.shape[0] > DENSE_ROWS:
            out = F.linear(rows, self.dense)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}"


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 `[out, in]` weights as the kernel sees them: (code - 8) * scale + zero per group."""
    groups = codes.float().view(codes.shape[0], -1, GROUP_SIZE)
    return ((groups - 8) * scale.float()[..., None] + zero.float()[..., None]).view(codes.shape)
