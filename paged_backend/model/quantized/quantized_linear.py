"""What the CPU int4 and int8 linear layers share: a quantized kernel for small steps, a dense copy of
the same dequantized weights for large ones, and a linear layer's shapes and bias.

Both quantized kernels (torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`) take bf16
activations and beat a dense matmul only for a few rows (docs/precision.md has the measured crossovers),
so past a layer's `dense_rows` a step multiplies by the copy. The copy is in the model's dtype: bf16 where
the CPU computes it natively, fp32 elsewhere (a bf16 matmul is emulated there, several times slower than
fp32), so a large step computes as the model's own weights
would and only the kernel's rows are rounded to bf16. The copy is dequantized from the codes, not kept
from the original weights, so every path computes the same model and which one a step takes changes only
rounding, as any change of matmul kernel does.

A layer loaded from a quantized checkpoint (checkpoint_layers.py) keeps no dense copy (`dense` None): the
checkpoint was chosen to fit memory, so every step multiplies by the codes, large ones more slowly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COMPUTE_DTYPE = torch.bfloat16  # the kernels' fast paths take bf16 activations (fp32 ones take a far slower int4 path)
DENSE_DTYPES = (torch.bfloat16, torch.float32)
NEVER_DENSE = 1 << 62  # the dense rows of a layer without a dense copy


class QuantizedLinear(torch.nn.Module):
    """A linear layer `[..., in] -> [..., out]` over a quantized weight and its dense copy."""

    # Steps of more rows multiply by the dense copy, by the copy's dtype (crossovers measured per subclass).
    dense_rows_by_dtype: dict[torch.dtype, int]

    def __init__(self, dense: torch.Tensor, bias: torch.Tensor | None,
                 dense_dtype: torch.dtype = COMPUTE_DTYPE, keep_dense: bool = True,
                 input_order: torch.Tensor | None = None) -> None:
        """`dense [out, in]`: the dequantized weight, kept in `dense_dtype` (the model's: bf16 or fp32) unless
        `keep_dense` is False (then every step multiplies by the codes). `input_order [in]`: which input each of
        the weight's columns multiplies (a GPTQ act-order checkpoint's order), None for their own."""
        super().__init__()
        if keep_dense and dense_dtype not in DENSE_DTYPES:
            raise ValueError(f"a quantized layer's dense copy is bf16 or fp32, not {dense_dtype}")
        self.out_features, self.in_features = dense.shape
        self.dense_dtype = dense_dtype  # the model's dtype: what LoRA weights beside this layer are kept in
        self.register_buffer("dense", dense.to(dense_dtype) if keep_dense else None)
        self.dense_rows = self.dense_rows_by_dtype[dense_dtype] if keep_dense else NEVER_DENSE
        self.register_buffer("input_order", None if input_order is None else input_order.long().contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def quantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows [n, in]` times the quantized weight, `[n, out]`, in the dtype of `rows`."""
        raise NotImplementedError

    def uses_dense(self, rows: torch.Tensor) -> bool:
        return rows.shape[0] > self.dense_rows

    def weight_float(self) -> torch.Tensor:
        """The weight this layer multiplies by, `[out, in]` in fp32."""
        weight = self.dense.float() if self.dense is not None else self.dequantized()
        if self.input_order is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.input_order] = weight
        return restored

    def dequantized(self) -> torch.Tensor:
        """The weight from the codes, `[out, in]` in fp32, its columns in `input_order` (a layer without a
        dense copy)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called about 200 times per step of the default model: cast_to skips no-op `.to` dispatches, which
        # with the rest of this method's Python cost as much as a small layer's kernel.
        rows = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            rows = rows.index_select(1, self.input_order)
        out = dense_matmul(rows, self.dense) if self.uses_dense(rows) else self.quantized_matmul(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def has_quantized_layers(model: torch.nn.Module) -> bool:
    return any(isinstance(module, QuantizedLinear) for module in model.modules())


def dense_matmul(rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """`rows [n, in]` times the dense copy `dense [out, in]` in the copy's dtype, returned in the rows' dtype."""
    return cast_to(F.linear(cast_to(rows, dense.dtype), dense), rows.dtype)


def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)
