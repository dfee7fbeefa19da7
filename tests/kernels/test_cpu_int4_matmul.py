"""The compiled CPU int4 matmul (kernels/cpu_int4_matmul.py): bf16 rows times Q4_1-grouped int4 codes equal the
fp32 product with the dequantized weight to within the bf16 rounding of the output (the AVX2 build: its
rounded-rows arithmetic, `reference()`, and the fp32 product to within that rounding's bound), for row counts on
both sides of the kernel's row blocks and shapes of one or many tiles and groups; a row's output does not depend on
the rows beside it; the tiled layout holds the codes, scales and zeros as given; Int4Linear multiplies through
it at every row count up to its dense threshold, and a layer made with the kernel switched off has no tiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from paged_backend.kernels import cpu_int4_matmul
from paged_backend.model.quantized import int4_linear
from paged_backend.model.quantized.int4_linear import Int4Linear, dequantize

pytestmark = pytest.mark.skipif(cpu_int4_matmul.library() is None,
                                reason="the int4 kernel needs AVX512-BF16 or AVX2, and a C compiler")

BLOCK = 12  # the C kernel's ROW_BLOCK: more rows reuse the first block's widened codes


def weight(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    scale = (torch.rand(out_features, in_features // 32, generator=g) * 0.02 + 1e-3).bfloat16()
    zero = (torch.randn(out_features, in_features // 32, generator=g) * 0.05).bfloat16()
    return codes, scale, zero


@pytest.mark.parametrize("rows", [1, 2, BLOCK, BLOCK + 1, 2 * BLOCK + 5])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (576, 1536)])
def test_products_equal_the_fp32_product_to_within_the_outputs_rounding(rows: int, shape: tuple[int, int]) -> None:
    codes, scale, zero = weight(*shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    got = cpu_int4_matmul.int4_matmul(x, *cpu_int4_matmul.tile(codes, scale, zero))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    product = x.double() @ dequantize(codes, scale, zero).double().T
    levels = cpu_int4_matmul.row_levels()
    if levels:
        # Each input off by at most half its group's step (max|x| / levels): the product off by at most the
        # weights' magnitudes times that, plus the output's rounding.
        step = x.double().view(rows, -1, 32).abs().amax(-1) / levels  # [rows, groups]
        magnitudes = dequantize(codes, scale, zero).double().abs().view(shape[0], -1, 32).sum(-1)  # [out, groups]
        bound = (step / 2) @ magnitudes.T
        assert ((got.double() - product).abs() <= bound + 2.0**-8 * product.abs()).all()
        expected = cpu_int4_matmul.reference(x, codes, scale, zero, levels)
    else:
        expected = product
    # The weights in fp32 (not rounded to bf16), sums in fp32: the output's rounding to bf16 (2^-9 relative) is
    # the error, with a margin for the fp32 sums.
    tolerance = 2.0**-8 * expected.abs() + 1e-4 * expected.abs().max()
    assert ((got.double() - expected).abs() <= tolerance).all()


def test_a_rows_output_does_not_depend_on_the_rows_beside_it() -> None:
    codes, scale, zero = weight(64, 256)
    tiled = cpu_int4_matmul.tile(codes, scale, zero)
    x = torch.randn(2 * BLOCK + 3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    together = cpu_int4_matmul.int4_matmul(x, *tiled)
    for count in (1, 5, BLOCK + 2):
        assert torch.equal(cpu_int4_matmul.int4_matmul(x[:count], *tiled), together[:count])
    assert torch.equal(torch.cat([cpu_int4_matmul.int4_matmul(row[None], *tiled) for row in x]), together)


def test_the_tiled_layout_holds_the_codes_scales_and_zeros() -> None:
    codes, scale, zero = weight(32, 64)
    tiled = cpu_int4_matmul.tile(codes, scale, zero)
    assert tiled.codes.shape == (2, 32, 16) and tiled.scales.shape == tiled.zeros.shape == (2, 2, 16)
    # Output row 16t + j, inputs 2p (low nibble) and 2p + 1 (high nibble).
    t, p, j = 1, 5, 3
    byte = int(tiled.codes[t, p, j])
    assert (byte & 15, byte >> 4) == (int(codes[16 * t + j, 2 * p]), int(codes[16 * t + j, 2 * p + 1]))
    assert tiled.scales[t, 0, j] == scale[16 * t + j, 0] and tiled.zeros[t, 1, j] == zero[16 * t + j, 1]


def test_int4_linear_takes_the_kernel_up_to_its_dense_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.nn.Linear(64, 48).bfloat16())
    assert layer.tiles is not None and layer.dense_rows == int4_linear.KERNEL_DENSE_ROWS[torch.bfloat16]
    calls = []
    real = cpu_int4_matmul.int4_matmul
    monkeypatch.setattr(cpu_int4_matmul, "int4_matmul", lambda rows, *tiled: calls.append(len(rows)) or real(rows, *tiled))
    for rows in (1, 7, layer.dense_rows, layer.dense_rows + 1):
        layer(torch.randn(rows, 64).bfloat16())
    assert calls == [1, 7, layer.dense_rows]  # past its dense rows, the dense copy
    with cpu_int4_matmul.switched_off():
        layer(torch.randn(3, 64).bfloat16())
        assert calls == [1, 7, layer.dense_rows]  # torch's kernel
        unswitched = Int4Linear.from_float(torch.nn.Linear(64, 48).bfloat16())
    assert unswitched.tiles is None and unswitched.dense_rows == int4_linear.DENSE_ROWS[torch.bfloat16]


def test_stacked_layers_tile_as_their_members() -> None:
    torch.manual_seed(0)
    layers = [Int4Linear.from_float(torch.nn.Linear(64, n, bias=False).bfloat16()) for n in (48, 16, 32)]
    stack = Int4Linear.stacked(layers)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(stack(x), torch.cat([layer(x) for layer in layers], -1))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="needs a C++ compiler")
def test_the_op_runs_its_cpp_kernel_with_the_same_products() -> None:
    assert cpu_int4_matmul.OP.language == "C++"
    codes, scale, zero = weight(48, 96)
    tiled = cpu_int4_matmul.tile(codes, scale, zero)
    x = torch.randn(2 * BLOCK + 3, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(cpu_int4_matmul.int4_matmul_op(x, *tiled), cpu_int4_matmul.int4_matmul(x, *tiled))
    assert torch.equal(cpu_int4_matmul.int4_matmul_op(x[:, ::1].t().contiguous().t(), *tiled),
                       cpu_int4_matmul.int4_matmul(x, *tiled))  # rows not contiguous
    with pytest.raises(RuntimeError, match="bf16 rows"):
        cpu_int4_matmul.int4_matmul_op(x.float(), *tiled)


def test_without_a_cpp_compiler_the_op_runs_its_python_kernel(tmp_path) -> None:
    script = """
import torch
from paged_backend.kernels import cpu_int4_matmul as k
assert k.library() is not None and k.OP.language == "Python", k.OP.language
codes = torch.randint(0, 16, (32, 64)); scale = torch.rand(32, 2).bfloat16(); zero = torch.rand(32, 2).bfloat16()
tiled = k.tile(codes, scale, zero); x = torch.randn(3, 64).bfloat16()
assert torch.equal(k.int4_matmul_op(x, *tiled), k.int4_matmul(x, *tiled))
"""
    env = {**os.environ, "CXX": "/bin/false", "PAGED_BACKEND_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "the CPU op cpu_int4_op.cpp could not be built" in run.stderr
