"""The engine's layers for a quantized checkpoint's linear weights (checkpoint_formats.py reads them).

Codes of 4 bits or fewer on CPU become an `Int4Linear` (int4_linear.py): the same kernels as the engine's own
int4 (the compiled AVX512-BF16 kernel, else torch's), fed the checkpoint's codes, scales and zero points as
they are, with no round trip through full precision. Its group is 32 inputs; a checkpoint's larger groups
(64, 128, a whole row) are runs of groups of 32 with the same scale, so they are exact in it. Unlike
`quantization="int4"` the layer keeps no dense copy: a checkpoint is chosen to fit in memory, so its codes are
held once and every step multiplies by them. What the kernels round: scales and zeros to bf16 (an fp16
scale loses its last 3 bits; `(8 - zero) * scale` likewise), and the rows to bf16, as for every int4 layer.

Everything else (8-bit codes, fp8 weights, group sizes that are not a multiple of 32, shapes the int4 kernel
cannot take, other devices than the CPU) becomes a `DequantizingLinear`: the codes kept as the file has them
(4-bit ones two per byte), the weight rebuilt in the activations' dtype for each call. It is exact to the
file's numbers and keeps the memory saving, but each call reads the weight about three times over. So on CPU,
steps of up to CODES_KERNEL_ROWS rows multiply 8-bit and fp8 codes directly instead, through the compiled
kernel (kernels/cpu_int8_matmul.c, `codes_matmul`): the codes widened in registers, group scales and zero points
applied as each group's sums close, in fp32. On the default model's 3,072 x 576 gate/up codes in groups of 32
(2 threads of an AMD EPYC with AVX2, three runs) one row took 0.12-0.20 ms there against 2.6-19 ms rebuilding the
weight (whose 7 MB temporaries sometimes come from fresh pages, sometimes not), 32 rows 3.6-4.2 ms against
5.5-21, 48 rows 5.6-7.7 against 6.1-17.5, and 64 rows 8.7-11.3 against 7.7-7.8: past CODES_KERNEL_ROWS, the
rebuild.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_backend.kernels import cpu_int8_matmul
from paged_backend.model.quantized.checkpoint_formats import QuantizedWeight, expand_groups
from paged_backend.model.quantized.int4_linear import GROUP_SIZE, Int4Linear
from paged_backend.model.quantized.quantized_linear import DENSE_DTYPES, QuantizedLinear, cast_to


CODES_KERNEL_ROWS = 48  # steps of up to this many rows multiply 8-bit codes through the kernel (module docstring)


class DequantizingLinear(QuantizedLinear):
    """A linear layer over a checkpoint's codes that rebuilds its weight for every call, but for small steps of
    8-bit codes on CPU (module docstring)."""

    dense_rows_by_dtype: dict[torch.dtype, int] = {}

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = weight.codes.shape
        shape = torch.empty(out_features, in_features, device="meta")
        super().__init__(shape, bias, dtype, keep_dense=False, input_order=weight.input_order)
        self.group_size, self.bits = weight.group_size, weight.bits
        codes, self.nibbles = stored_codes(weight.codes, weight.bits)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("zeros", None if weight.zeros is None else weight.zeros.float().contiguous())
        if not self.nibbles:
            cpu_int8_matmul.library()  # the op's C++ kernel loaded now: a graph being traced cannot load it

    def dequantized(self) -> torch.Tensor:
        codes = self.codes
        if self.nibbles:
            codes = torch.stack([codes & 0x0F, codes >> 4], -1).view(self.out_features, self.in_features)
        return cpu_int8_matmul.dequantize_codes(codes, self.scales, self.zeros, self.group_size)

    def quantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.nibbles or self.codes.device.type != "cpu":
            return cast_to(F.linear(rows, self.dequantized().to(rows.dtype)), rows.dtype)
        # One op, eager or compiled: it chooses between the kernel and the rebuilt weight at run time, as
        # int8_linear.py's does, and its kernel is C++ where that builds (kernels/cpu_codes_op.cpp).
        return cpu_int8_matmul.codes_matmul_op(rows, self.codes, self.scales, self.zeros, self.group_size,
                                               CODES_KERNEL_ROWS)

    def extra_repr(self) -> str:
        group = "row" if self.group_size >= self.in_features else self.group_size
        return f"{super().extra_repr()}, bits={self.bits}, group_size={group}"


def stored_codes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, bool]:
    """The codes in the fewest bytes that hold them (fp8 as it is, 8-bit ones a byte each, 4-bit ones two a
    byte where the inputs pair up), and whether they are two a byte."""
    if codes.dtype != torch.int16:
        return codes, False
    if bits <= 4 and codes.shape[1] % 2 == 0:
        pairs = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4), True
    return codes.to(torch.uint8 if codes.min() >= 0 else torch.int8), False


def takes_int4(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the int4 kernels can run this weight: CPU, 4-bit integer codes, the kernels' shapes and a
    group that is a run of groups of 32."""
    out_features, in_features = weight.codes.shape
    return (device.type == "cpu" and dtype in DENSE_DTYPES and weight.bits <= 4 and weight.codes.dtype == torch.int16
            and out_features % 16 == 0 and in_features % GROUP_SIZE == 0 and weight.group_size % GROUP_SIZE == 0)


def build_layer(weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> QuantizedLinear:
    """The engine's layer for one checkpoint weight: an Int4Linear where the int4 kernels take it, else a
    DequantizingLinear; `dtype` is the model's."""
    bias = None if bias is None else bias.to(dtype)
    if not takes_int4(weight, dtype, device):
        return DequantizingLinear(weight, bias, dtype).to(device)
    in_features = weight.codes.shape[1]
    scales = expand_groups(weight.scales, weight.group_size, in_features)[:, ::GROUP_SIZE]
    zeros = 0 if weight.zeros is None else expand_groups(weight.zeros, weight.group_size, in_features)[:, ::GROUP_SIZE]
    return Int4Linear(weight.codes.to(torch.uint8), scales, -zeros * scales, bias, dtype, keep_dense=False,
                      input_order=weight.input_order)


def kernel_name(layer: QuantizedLinear) -> str:
    """What multiplies by this layer's codes, for the start-up log."""
    if isinstance(layer, Int4Linear):
        return "the compiled int4 kernel" if layer.tile_codes is not None else "torch's CPU int4 kernel"
    if layer.codes.device.type == "cpu" and not layer.nibbles and cpu_int8_matmul.serves_codes(
            torch.empty(1, layer.in_features, dtype=layer.dense_dtype), layer.codes):
        return (f"the compiled 8-bit codes kernel (steps of up to {CODES_KERNEL_ROWS} rows; larger ones rebuild "
                "the weight)")
    return "a dequantizing matmul (the weight rebuilt per call)"
