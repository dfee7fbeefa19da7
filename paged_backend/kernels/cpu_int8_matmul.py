"""A compiled CPU kernel for a few rows times an int8 weight: the LM head of a one-stream int4 model.

One stream's decode step multiplies one row by the int8 head (model/quantized/int8_linear.py: 49,152 x 576 for the default
model, 28 MB of codes), a pass over memory that torch's `_weight_int8pack_mm` made well below what the machine's
memory gives (docs/benchmarks.md). The kernel in cpu_int8_matmul.c streams each output row's codes once, in order,
widens them in registers and multiplies them with up to MOST_ROWS input rows kept in fp32, the output rows
split between torch's threads. With more rows (a batched step on a CPU without AVX512-BF16) it widens four output
rows' codes at a time into a small fp32 panel and multiplies them with the input rows three at a time: on the
default model's head at 32 rows, 23 ms against 36 ms in torch's kernel and 38 ms by the dense fp32 copy (AMD EPYC
with AVX2, 2 threads). Its products are fp32 sums of the rows as given, each output the same sum in the same order
whatever the number of rows, where torch's kernel rounds the rows to bf16 first.

On a CPU with AVX512-BF16 the same library multiplies any number of bf16 rows by the codes tiled 16 output rows at
a time (`tile`), widened to bf16 once per block of 16 rows and multiplied by `vdpbf16ps`: on the default model's
head, its codes from memory, faster than the kernel above at one row and than the dense bf16 copy up to the tiled
threshold (docs/benchmarks.md has the times). Same arithmetic: products exact, fp32 sums, the scale at the end.

The same kernel multiplies rows by an fp16 or bf16 weight (`half_matmul`: an fp32 model's LM head kept in the 16
bits its checkpoint has, model/quantized/half_head.py), each weight widened exactly in registers (F16C for fp16)
and no scale: on the default model's head shape at one row, 2.6 ms against 9.1 ms for `F.linear` on the fp32 weight
(AMD EPYC with AVX2, 2 threads).

The same library multiplies rows by a checkpoint's 8-bit codes (`codes_matmul`: int8, uint8 or fp8 e4m3fn codes,
a scale and a zero point per output row and group of inputs, model/quantized/checkpoint_layers.py): each output
row's codes widened in registers, four output rows at a time for one input row, a group's sums scaled as it
closes and the zero points taken off at the end. A layer calls it through the op `paged_backend::codes_matmul`,
whose CPU kernel is C++ where that builds (cpu_codes_op.cpp), else codes_matmul_kernel() here.

Built on the user's machine like the other CPU kernels (cpu_build.py); without a compiler, or with
`PAGED_BACKEND_CPU_KERNEL=0`, torch's kernel serves the head as before, and 8-bit layers rebuild their weight.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_suffix(".c")
MOST_ROWS = 4  # rows the C kernel multiplies in one pass over the codes; more go through its panel
TILE = 16  # output rows per tile of the tiled layout
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
SWITCH = cpu_build.Switch()  # switched_off(): torch's kernel inside the block (tests, benchmarks)
switched_off = SWITCH.switched_off


def serves(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel multiplies these `rows [n, in]` by `codes [out, in]` with bf16 `scales [out]` here."""
    return (not SWITCH.off and rows.device.type == "cpu" and rows.dim() == 2 and rows.shape[0] >= 1
            and rows.dtype in ROW_DTYPES and codes.dtype == torch.int8 and codes.is_contiguous()
            and scales.dtype == torch.bfloat16 and scales.is_contiguous() and library() is not None)


def int8_matmul(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`rows [n, in]` times `codes [out, in] * scales[:, None]`, as fp32 `[n, out]`. The caller checked serves()."""
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], codes.shape[0], dtype=torch.float32)
    failed = library().int8_matmul(rows.data_ptr(), ROW_DTYPES[rows.dtype], rows.shape[0], rows.shape[1],
                                   codes.data_ptr(), scales.data_ptr(), codes.shape[0], out.data_ptr(),
                                   torch.get_num_threads())
    if failed:
        raise MemoryError("the int8 matmul kernel could not allocate its rows")
    return out


# A 16-bit float weight, by dtype: what half_matmul() takes (the C kernel's WEIGHT_* kinds).
HALF_KINDS = {torch.float16: 1, torch.bfloat16: 2}


@functools.cache
def takes_half(dtype: torch.dtype) -> bool:
    """Whether this machine's build multiplies rows by a weight of this 16-bit `dtype` (fp16 needs the F16C
    conversions); asked once per dtype, not per call."""
    lib = library()
    return dtype in HALF_KINDS and lib is not None and (dtype != torch.float16 or bool(lib.takes_f16()))


def serves_half(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel multiplies these `rows [n, in]` by the fp16 or bf16 `weight [out, in]` here."""
    return (not SWITCH.off and rows.device.type == "cpu" and rows.dim() == 2 and rows.shape[0] >= 1
            and rows.dtype in ROW_DTYPES and weight.is_contiguous() and takes_half(weight.dtype))


def half_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows [n, in]` times the fp16 or bf16 `weight [out, in]` transposed, as fp32 `[n, out]`: each output the
    fp32 sum of the rows' products with the weight's exact values. The caller checked serves_half()."""
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    failed = library().half_matmul(rows.data_ptr(), ROW_DTYPES[rows.dtype], rows.shape[0], rows.shape[1],
                                   weight.data_ptr(), HALF_KINDS[weight.dtype], weight.shape[0], out.data_ptr(),
                                   torch.get_num_threads())
    if failed:
        raise MemoryError("the 16-bit weight kernel could not allocate its rows")
    return out


def tiled_here(codes: torch.Tensor) -> torch.Tensor | None:
    """`codes [out, in]` tiled for the several-rows kernel (tile()) where it runs: built here (AVX512-BF16), not
    switched off, and the shape its tiles take; else None."""
    out_features, in_features = codes.shape
    runs = not SWITCH.off and library() is not None and bool(library().tiled_available())
    return tile(codes) if runs and out_features % TILE == 0 and in_features % 2 == 0 else None


def tile(codes: torch.Tensor) -> torch.Tensor:
    """`codes [out, in]` (out a multiple of 16, in even) as `[out / 16, in / 2, 16, 2]`: output row 16t + j's codes
    for inputs 2p and 2p + 1 side by side."""
    out_features, in_features = codes.shape
    return codes.view(out_features // TILE, TILE, in_features // 2, 2).transpose(1, 2).contiguous()


def serves_tiled(rows: torch.Tensor) -> bool:
    """Whether the several-rows kernel multiplies these `rows [n, in]` by a weight tiled here (which a layer
    holds only where tiled_here() tiled it)."""
    return not SWITCH.off and rows.device.type == "cpu" and rows.dim() == 2 and rows.dtype == torch.bfloat16


def int8_matmul_tiled(rows: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 `rows [n, in]` times the tiled codes (tile()) scaled by bf16 `scales [out]`, as fp32 `[n, out]`."""
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], tiled.shape[0] * TILE, dtype=torch.float32)
    failed = library().int8_matmul_tiled(rows.data_ptr(), rows.shape[0], rows.shape[1], tiled.data_ptr(),
                                         scales.data_ptr(), out.shape[1], out.data_ptr(), torch.get_num_threads())
    if failed:
        raise ValueError(f"the tiled int8 kernel cannot take rows {tuple(rows.shape)} times {tuple(tiled.shape)}")
    return out


# A checkpoint's 8-bit codes, by dtype: what codes_matmul() takes (the C kernel's CODES_* kinds).
CODE_KINDS = {torch.int8: 0, torch.uint8: 1, torch.float8_e4m3fn: 2}
OP_SOURCE = Path(__file__).with_name("cpu_codes_op.cpp")


def serves_codes(rows: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether the kernel multiplies these `rows [n, in]` by a checkpoint's 8-bit `codes [out, in]` here."""
    return (not SWITCH.off and rows.device.type == "cpu" and rows.dim() == 2 and rows.shape[0] >= 1
            and rows.dtype in ROW_DTYPES and codes.dtype in CODE_KINDS and codes.is_contiguous()
            and library() is not None)


def codes_matmul(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int) -> torch.Tensor:
    """`rows [n, in]` times the weight `(codes - zeros) * scales` (`codes [out, in]` int8, uint8 or fp8 e4m3fn;
    fp32 `scales` and `zeros [out, groups]`, zeros None where there are none; groups of `group_size` inputs, the
    last possibly short), as fp32 `[n, out]`. The caller checked serves_codes()."""
    rows = rows.contiguous()
    scales = scales.float().contiguous()
    zeros = None if zeros is None else zeros.float().contiguous()
    out = torch.empty(rows.shape[0], codes.shape[0], dtype=torch.float32)
    failed = library().codes_matmul(rows.data_ptr(), ROW_DTYPES[rows.dtype], rows.shape[0], rows.shape[1],
                                    codes.data_ptr(), CODE_KINDS[codes.dtype], scales.data_ptr(),
                                    None if zeros is None else zeros.data_ptr(), group_size, codes.shape[0],
                                    out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("the 8-bit codes kernel could not allocate its rows")
    return out


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """fp32 `(codes - zeros) * scales`, `[out, in]`, from the per-group `scales` and `zeros [out, groups]`."""
    in_features = codes.shape[1]
    weight = codes.float()
    if zeros is not None:
        weight = weight - zeros.float().repeat_interleave(group_size, 1)[:, :in_features]
    return weight * scales.float().repeat_interleave(group_size, 1)[:, :in_features]


def codes_matmul_kernel(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                        group_size: int, kernel_rows: int) -> torch.Tensor:
    """The op `codes_matmul`'s Python kernel: `rows [n, in]` times `dequantize_codes(...)`, in the dtype of
    `rows`; through the compiled kernel for up to `kernel_rows` rows where it serves, else the weight rebuilt.
    cpu_codes_op.cpp is the same in C++."""
    if rows.shape[0] <= kernel_rows and serves_codes(rows, codes):
        return codes_matmul(rows, codes, scales, zeros, group_size).to(rows.dtype)
    return torch.nn.functional.linear(rows, dequantize_codes(codes, scales, zeros, group_size).to(rows.dtype))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use, or None (switched off, or no compiler: said once). Where it
    loads, the op `codes_matmul`'s kernel in C++ replaces its Python one (cpu_codes_op.cpp says why) where that
    builds too."""
    lib = cpu_build.load(SOURCE, declare, "the int8 head runs through torch's kernel")
    if lib is None:
        return None
    CODES_OP.load_cpp(OP_SOURCE, ctypes.cast(lib.codes_matmul, ctypes.c_void_p).value,
                      "8-bit checkpoint layers call their kernel through Python")
    return lib


def declare(lib: ctypes.CDLL) -> None:
    lib.int8_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.int8_matmul.restype = ctypes.c_int
    lib.codes_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_int]
    lib.codes_matmul.restype = ctypes.c_int
    lib.half_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.half_matmul.restype = ctypes.c_int
    lib.takes_f16.argtypes = []
    lib.takes_f16.restype = ctypes.c_int
    lib.tiled_available.argtypes = []
    lib.tiled_available.restype = ctypes.c_int
    lib.int8_matmul_tiled.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.int8_matmul_tiled.restype = ctypes.c_int


# The op an 8-bit checkpoint layer calls (checkpoint_layers.py), registered through torch.library's low-level
# API as the int4 op is (cpu_int4_matmul.py). Its CPU kernel is codes_matmul_kernel() until library() loads the
# C++ one.
CODES_OP = cpu_build.OpKernel("codes_matmul(Tensor rows, Tensor codes, Tensor scales, Tensor? zeros, int group_size, "
                              "int kernel_rows) -> Tensor", codes_matmul_kernel)
codes_matmul_op = CODES_OP.op


@torch.library.register_fake("paged_backend::codes_matmul")
def _(rows, codes, scales, zeros, group_size, kernel_rows):
    return rows.new_empty(rows.shape[0], codes.shape[0])
