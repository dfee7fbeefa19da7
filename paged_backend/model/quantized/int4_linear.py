"""Int4 weight-only linear layers on CPU: `LLM(..., quantization="int4")`.

A weight is stored as 4-bit codes in groups of 32 along the input dimension, each group with its own
scale and offset: `w = q * d + m` for codes `q` in 0..15. That is the layout of llama.cpp's Q4_1 (the
default model's own GGUF tensors), so those load as they are (gguf_int4.py); any other float weight
is rounded to it (`from_float`: `m` the group's minimum, `d` its range / 15).

Small steps multiply by the codes through torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
bf16 activations), several times faster than bf16 or fp32 weights at one row and ahead for a few rows.
Past `DENSE_ROWS[torch.bfloat16]` rows the kernel falls behind a dense bf16 matmul, so larger steps
multiply by a dense bf16 copy of the same dequantized weights instead (quantized_linear.py). On a CPU
without native bf16 the copy is fp32, and the kernel (rows rounded to bf16 for it and back) against fp32
weights streamed from memory as in a step falls behind past `DENSE_ROWS[torch.float32]` rows
(docs/precision.md has the measured crossovers). The copy costs as much as the weights it replaces: on
CPU this format buys decode speed, not memory.

Where the CPU has AVX512-BF16 or AVX2, the engine's own compiled kernel (kernels/cpu_int4_matmul.py) takes
every step up to `KERNEL_DENSE_ROWS` rows instead of torch's, from the same codes tiled for it: faster than
torch's at every row count up to there (docs/benchmarks.md), with torch's arithmetic. torch's kernel stays for a
layer made where it does not run, or inside `cpu_int4_matmul.switched_off()`.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import cpu_int4_matmul
from paged_backend.kernels.cpu_int4_matmul import TiledWeight, int4_matmul_op
from paged_backend.model.quantized.quantized_linear import (
    COMPUTE_DTYPE,
    NEVER_DENSE,
    QuantizedLinear,
    cast_to,
    dense_matmul,
)

GROUP_SIZE = 32  # weights per (scale, offset) pair along the input dimension, as in GGUF's Q4_1
# Steps of more rows multiply by the dense copy, by the copy's dtype (measured crossovers: docs/precision.md).
DENSE_ROWS = {torch.bfloat16: 32, torch.float32: 24}
# The same where the compiled kernel (kernels/cpu_int4_matmul.py) multiplies: it kept ahead of a dense bf16
# matmul to about 128 rows (benchmarks/cpu_int4_batch.py). On an AVX2 CPU (an fp32 model) it led the fp32 copy to
# about 48 rows at one thread and past 96 at two; past 64 rows the fp32 copy multiplies the rows unrounded.
KERNEL_DENSE_ROWS = {torch.bfloat16: 128, torch.float32: 64}


def can_quantize(linear: torch.nn.Linear) -> bool:
    """The kernel's shape rules: output features a multiple of 16, input features of the group size."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP_SIZE == 0


def has_int4_layers(model: torch.nn.Module) -> bool:
    return most_int4_rows(model) is not None


def most_int4_rows(model: torch.nn.Module) -> int | None:
    """The most rows a step of `model` multiplies by int4 codes (past them, by the dense copies); None
    without int4 layers that switch (a checkpoint's, without dense copies, take every step on the codes)."""
    return max((module.dense_rows for module in model.modules()
                if isinstance(module, Int4Linear) and module.dense is not None), default=None)


class Int4Linear(QuantizedLinear):
    """A linear layer whose weight is 4-bit codes with a scale and offset per group of 32 inputs."""

    dense_rows_by_dtype = DENSE_ROWS

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bias: torch.Tensor | None = None, dense_dtype: torch.dtype = COMPUTE_DTYPE,
                 keep_dense: bool = True, input_order: torch.Tensor | None = None) -> None:
        """`codes [out, in]` in 0..15, `scales` and `offsets [out, in / 32]`: weight = codes * scales + offsets.
        `dense_dtype`: the model's dtype, that of the dense copy large steps multiply by. Without `keep_dense`
        (a quantized checkpoint, loaded to save memory) there is no dense copy, and the codes are kept once:
        tiled where the compiled kernel runs, else in torch's layout. `input_order [in]`: the inputs' order the
        codes' columns are in (a GPTQ act-order checkpoint's), applied to every step's rows."""
        out_features, in_features = codes.shape
        if out_features % 16 or in_features % GROUP_SIZE:
            raise ValueError(f"int4 weights need out_features % 16 == 0 and in_features % {GROUP_SIZE} == 0, "
                             f"got {out_features} x {in_features}")
        # The kernel dequantizes as (code - 8) * scale + zero, with scale and zero in the activations' dtype.
        scale = scales.float().to(COMPUTE_DTYPE)
        zero = (offsets.float() + 8 * scales.float()).to(COMPUTE_DTYPE)
        dense = dequantize(codes, scale, zero) if keep_dense else torch.empty(codes.shape, device="meta")
        super().__init__(dense, bias, dense_dtype, keep_dense, input_order)
        # The same codes in the layout of the compiled kernel, where it runs (not saved: tiled again at load).
        tiled = cpu_int4_matmul.tiled_here(codes, scale, zero)
        torch_layout = keep_dense or tiled is None
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1) if torch_layout else None
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale, zero], -1).transpose(0, 1).contiguous() if torch_layout else None)
        self.register_tiles(tiled)

    def register_tiles(self, tiled: TiledWeight | None) -> None:
        for name, tensor in zip(TiledWeight._fields, tiled or (None,) * len(TiledWeight._fields)):
            self.register_buffer(f"tile_{name}", tensor, persistent=False)
        rows_by_dtype = DENSE_ROWS if tiled is None else KERNEL_DENSE_ROWS
        self.dense_rows = rows_by_dtype[self.dense_dtype] if self.dense is not None else NEVER_DENSE

    @property
    def tiles(self) -> TiledWeight | None:
        """The weight in the several-rows kernel's layout (kernels/cpu_int4_matmul.py), where that kernel runs."""
        return None if self.tile_codes is None else TiledWeight(self.tile_codes, self.tile_scales, self.tile_zeros)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> Int4Linear:
        """Round `linear`'s weight to int4 per group of 32: offset the group's minimum, scale its range / 15;
        the dense copy in the weight's dtype."""
        weight = linear.weight.detach().float()
        groups = weight.view(weight.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).view_as(weight)
        return cls(codes, scales, low, linear.bias, linear.weight.dtype)

    @classmethod
    def stacked(cls, layers: list[Int4Linear]) -> Int4Linear:
        """One layer computing `layers` side by side (their outputs concatenated), from their packed codes,
        scales and dense copies as they are (fused_projections.py); `packed_rows_stack` says when it can."""
        stack = cls.__new__(cls)
        first = layers[0]
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        dense = torch.cat([layer.dense_or_empty() for layer in layers])
        QuantizedLinear.__init__(stack, dense, bias, first.dense_dtype, first.dense is not None, first.input_order)
        # torch's layout, where the layers have it: packed rows along dim 0, scales and zeros `[groups, out, 2]`.
        for name, out_dim in (("packed", 0), ("scales_and_zeros", 1)):
            parts = [getattr(layer, name) for layer in layers]
            stack.register_buffer(name, None if parts[0] is None else torch.cat(parts, out_dim))
        tiled = [layer.tiles for layer in layers]
        stack.register_tiles(None if any(t is None for t in tiled) else TiledWeight(*map(torch.cat, zip(*tiled))))
        return stack

    def dense_or_empty(self) -> torch.Tensor:
        """The dense copy, or an empty one of its shape (no memory) where the layer keeps none."""
        if self.dense is not None:
            return self.dense
        return torch.empty(self.out_features, self.in_features, dtype=self.dense_dtype, device="meta")

    def dequantized(self) -> torch.Tensor:
        if self.tile_codes is not None:
            return dequantize(*cpu_int4_matmul.untile(self.tiles))
        # torch's layout has no public unpacking: the kernel times the identity gives the weight, rounded to bf16.
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_and_zeros).t().float()

    def quantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        kernel_rows = cast_to(rows, COMPUTE_DTYPE)
        if self.tile_codes is not None and cpu_int4_matmul.serves(kernel_rows):
            # The registered op inside a graph being compiled, its implementation directly in an eager forward.
            matmul = int4_matmul_op if torch.compiler.is_compiling() else cpu_int4_matmul.int4_matmul
            return cast_to(matmul(kernel_rows, self.tile_codes, self.tile_scales, self.tile_zeros), rows.dtype)
        if self.packed is None:
            # Tiles alone (no dense copy) and the compiled kernel switched off: the weight from the tiles.
            return dense_matmul(rows, self.dequantized().to(self.dense_dtype))
        if torch.compiler.is_compiling():
            # The same kernel, its group size a tensor computed in the graph: inductor's lowering of
            # _weight_int4pack_mm_for_cpu adds the group size as a graph constant, which inside a nested compile
            # region (layer_regions.py) was read as another constant ("group size must be a scalar", torch 2.13).
            out = torch.ops.quantized.int4mm_packed_weight_cpu(kernel_rows, self.packed,
                                                               torch.full((), GROUP_SIZE, dtype=torch.int64),
                                                               self.scales_and_zeros)
        else:
            out = torch._weight_int4pack_mm_for_cpu(kernel_rows, self.packed, GROUP_SIZE,
                                                    self.scales_and_zeros)
        return cast_to(out, rows.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={GROUP_SIZE}"


_stackable: dict[tuple[tuple[int, ...], int], bool] = {}


def packed_rows_stack(out_features: list[int], in_features: int) -> bool:
    """Whether layers of these output sizes (and this input size) packed one by one, concatenated, equal them
    packed together. The kernel packs output rows in blocks (64 on the CPUs measured), so sizes that are
    multiples of the block stack; the answer is found by packing, not assumed, on the CPU that runs."""
    key = (tuple(out_features), in_features)
    if key not in _stackable:
        generator = torch.Generator().manual_seed(0)  # not the global one: a user's seeded run stays as it was
        codes = [torch.randint(0, 16, (n, in_features), dtype=torch.int32, generator=generator) for n in out_features]
        alone = torch.cat([torch._convert_weight_to_int4pack_for_cpu(c, 1) for c in codes])
        _stackable[key] = torch.equal(alone, torch._convert_weight_to_int4pack_for_cpu(torch.cat(codes), 1))
    return _stackable[key]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 `[out, in]` weights as the kernel sees them: (code - 8) * scale + zero per group."""
    groups = codes.float().view(codes.shape[0], -1, GROUP_SIZE)
    return ((groups - 8) * scale.float()[..., None] + zero.float()[..., None]).view(codes.shape)
