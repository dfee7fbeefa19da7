"""A compiled CPU kernel for rows times an int4 weight: every int4 step of an int4 model short of a long prefill.

torch's int4 kernel (`_weight_int4pack_mm_for_cpu`) is built for one row: past it, it widens the codes again
for every few rows, so its rate stops growing with the rows and a few dozen rows took longer than a dense bf16
matmul. The kernel in cpu_int4_matmul.c widens each code once per call and multiplies it with every row by
AVX512-BF16 dot products, scaling each group's sums in fp32: faster than torch's kernel at every row count, and
than the dense copy up to about 128 rows, past which the dense copy leads (docs/benchmarks.md has the times;
`python benchmarks/cpu_int4_batch.py`). Its arithmetic there is torch's kernel's: the rows rounded to bf16, the
weights (code - 8) * scale + zero in fp32 (never rounded to bf16), products and sums in fp32, the output rounded
to bf16.

On an AVX2 CPU (no bf16 dot product) the kernel rounds each row to integers per group of 32 inputs (16,256
levels each side of zero, two bytes an input) and multiplies the codes by them in integers (`vpmaddubsw`): the
widening of codes to fp32 bound the one-row step there, and byte products take fewer instructions. An input is
off by at most 1/32,512 of its group's largest; `reference()` is that arithmetic in PyTorch. Either way a row's
output does not depend on the other rows of the call, so a request's tokens do not depend on what it is batched with.

Needs AVX512-BF16, or AVX2 with FMA (`available()`); built on the user's machine like the other CPU kernels
(cpu_build.py).
Elsewhere, without a compiler, or with `PAGED_BACKEND_CPU_KERNEL=0`, torch's kernel serves as before.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from . import cpu_build

SOURCE = Path(__file__).with_suffix(".c")
OP_SOURCE = Path(__file__).with_name("cpu_int4_op.cpp")  # the op's kernel in C++
TILE = 16  # output rows per tile of the kernel's layout
SWITCH = cpu_build.Switch()  # switched_off(): torch's kernel inside the block (tests, benchmarks)
switched_off = SWITCH.switched_off


class TiledWeight(NamedTuple):
    """An int4 weight in the kernel's layout: `codes [out / 16, in / 2, 16]` uint8, byte j of pair p holding
    output row 16t + j's codes for inputs 2p (low nibble) and 2p + 1 (high); `scales` and `zeros
    [out / 16, in / 32, 16]` bf16. A weight is (code - 8) * scale + zero."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def tile(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> TiledWeight:
    """The kernel's layout of `codes [out, in]` (0..15) with bf16 `scale` and `zero [out, in / 32]`."""
    out_features, in_features = codes.shape
    tiles = out_features // TILE
    nibbles = codes.to(torch.uint8).view(tiles, TILE, in_features // 2, 2)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).transpose(1, 2).contiguous()

    def by_tile(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.bfloat16).view(tiles, TILE, -1).transpose(1, 2).contiguous()

    return TiledWeight(packed, by_tile(scale), by_tile(zero))


def row_levels() -> int:
    """The levels each side of zero the kernel here rounds a row's group of inputs to (the AVX2 build), or 0 where
    it multiplies the rows as bf16 (or does not run)."""
    lib = library()
    return 0 if lib is None else lib.row_levels()


def reference(rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              levels: int) -> torch.Tensor:
    """The AVX2 build's arithmetic, in fp64 before the output's rounding, on bf16 `rows [n, in]`, `codes [out,
    in]` and bf16 `scale`, `zero [out, in / 32]`: each row's group of 32 inputs rounded to `v = round(x * (levels
    / max|x|))` (fp32, ties to even), so `x ~ v * step` with `step = max|x| / levels`; a group adds
    `scale * step * sum(code * v) + (zero - 8 * scale) * sum(x)`."""
    x = rows.float().view(rows.shape[0], -1, 32)
    largest = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, levels) / largest, torch.zeros_like(largest))
    v = torch.round(x * inverse).double()
    step = (largest / levels).double().squeeze(-1)  # [n, groups]
    products = torch.einsum("ngi,ogi->nog", v, codes.double().view(codes.shape[0], -1, 32))
    scale, zero = scale.double(), zero.double()
    return (products * scale * step[:, None, :] + (zero - 8 * scale) * x.double().sum(-1)[:, None, :]).sum(-1)


def untile(tiled: TiledWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tile()'s inverse: `codes [out, in]` uint8 and bf16 `scale`, `zero [out, in / 32]`."""
    tiles, pairs, _ = tiled.codes.shape
    nibbles = torch.stack([tiled.codes & 0x0F, tiled.codes >> 4], -1)  # [tiles, in / 2, 16, 2]
    codes = nibbles.transpose(1, 2).reshape(tiles * TILE, pairs * 2)

    def by_row(values: torch.Tensor) -> torch.Tensor:
        return values.transpose(1, 2).reshape(tiles * TILE, -1)

    return codes, by_row(tiled.scales), by_row(tiled.zeros)


def tiled_here(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> TiledWeight | None:
    """The weight tiled (tile()) where the kernel runs: built here and not switched off; else None. A layer
    made inside `switched_off()` has no tiles and always runs torch's kernel (a compiled graph, which took its
    kernel when traced and does not look at the switch, too)."""
    return tile(codes, scale, zero) if not SWITCH.off and library() is not None else None


def serves(rows: torch.Tensor) -> bool:
    """Whether the kernel multiplies these `rows [n, in]` by a weight tiled here (which a layer does only where
    library() loads; not asked again here, as a graph being traced cannot call it)."""
    return not SWITCH.off and rows.device.type == "cpu" and rows.dim() == 2 and rows.dtype == torch.bfloat16


def int4_matmul(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """bf16 `rows [n, in]` times the tiled weight `(codes, scales, zeros)` (a TiledWeight's parts), as bf16
    `[n, out]`. The caller checked serves()."""
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], codes.shape[0] * TILE, dtype=torch.bfloat16)
    failed = library().int4_matmul(rows.data_ptr(), rows.shape[0], rows.shape[1], codes.data_ptr(),
                                   scales.data_ptr(), zeros.data_ptr(), out.shape[1], out.data_ptr(),
                                   torch.get_num_threads())
    if failed:
        raise MemoryError("the int4 matmul kernel could not allocate its panel")
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use, or None (switched off, no compiler, or a CPU without
    AVX512-BF16 or AVX2: the first two said once). Where it loads, the op's kernel in C++ replaces its Python
    one (cpu_int4_op.cpp says why) where that builds too."""
    lib = cpu_build.load(SOURCE, declare, "int4 layers run through torch's kernel")
    if lib is None or not lib.available():
        return None
    OP.load_cpp(OP_SOURCE, ctypes.cast(lib.int4_matmul, ctypes.c_void_p).value,
                "the int4 op calls its kernel through Python")
    return lib


def declare(lib: ctypes.CDLL) -> None:
    lib.available.argtypes = []
    lib.available.restype = ctypes.c_int
    lib.row_levels.argtypes = []
    lib.row_levels.restype = ctypes.c_int
    lib.int4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.int4_matmul.restype = ctypes.c_int


# The op a compiled step calls for an int4 projection: registered through torch.library's low-level API, not
# `custom_op`, whose Python wrapping made each call markedly slower (docs/benchmarks.md). Its CPU kernel is the
# Python function int4_matmul() until library() loads the C++ one.
OP = cpu_build.OpKernel("int4_matmul(Tensor rows, Tensor codes, Tensor scales, Tensor zeros) -> Tensor", int4_matmul)
int4_matmul_op = OP.op


@torch.library.register_fake("paged_backend::int4_matmul")
def _(rows, codes, scales, zeros):
    return rows.new_empty(rows.shape[0], codes.shape[0] * TILE)
