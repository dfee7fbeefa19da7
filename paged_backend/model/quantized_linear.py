"""What the CPU int4 and int8 linear layers share: a quantized kernel for small steps, a dense copy of
the same dequantized weights for large ones, and a linear layer's shapes and bias.

Both quantized kernels (torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`) beat a dense
bf16 matmul only for a few rows (int4_linear.py and int8_linear.py have the measured crossovers), so
past a subclass's `dense_rows` a step multiplies by the copy. The copy is dequantized from the codes,
not kept from the original weights, so every path computes the same model and which one a step takes
changes only rounding, as any change of matmul kernel does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COMPUTE_DTYPE = torch.bfloat16  # the kernels' fast paths take bf16 activations (fp32 was 25x slower for int4)


class QuantizedLinear(torch.nn.Module):
    """A linear layer `[..., in] -> [..., out]` over a quantized weight and its dense bf16 copy."""

    dense_rows: int  # steps of more rows multiply by the dense copy

    def __init__(self, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
        """`dense [out, in]`: the dequantized weight, in fp32 or COMPUTE_DTYPE."""
        super().__init__()
        self.out_features, self.in_features = dense.shape
        self.register_buffer("dense", dense.to(COMPUTE_DTYPE))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def quantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows [n, in]` (COMPUTE_DTYPE) times the quantized weight, `[n, out]`."""
        raise NotImplementedError

    def uses_dense(self, rows: torch.Tensor) -> bool:
        return rows.shape[0] > self.dense_rows

    def weight_float(self) -> torch.Tensor:
        """The weight this layer multiplies by, `[out, in]` in fp32."""
        return self.dense.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called about 200 times per step of the default model: the dtype checks skip two no-op `.to`
        # dispatches, which with the rest of this method's Python cost as much as a small layer's kernel.
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != COMPUTE_DTYPE:
            rows = rows.to(COMPUTE_DTYPE)
        out = F.linear(rows, self.dense) if self.uses_dense(rows) else self.quantized_matmul(rows)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def has_quantized_layers(model: torch.nn.Module) -> bool:
    return any(isinstance(module, QuantizedLinear) for module in model.modules())
