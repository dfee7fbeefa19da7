"""The compiled CPU kernel for a checkpoint's 8-bit codes (`codes_matmul` in kernels/cpu_int8_matmul.py): rows
times `(codes - zeros) * scales` with int8, uint8 and fp8 codes, groups of any size (the last short, or a whole
row), with and without zero points, equal the fp64 product with the dequantized weight; each row's outputs are
the same alone and among others; every fp8 byte reads as torch's own conversion says; a checkpoint layer takes the
kernel for small steps and the rebuilt weight past CODES_KERNEL_ROWS, through the op's C++ kernel and through its
Python one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_backend.kernels import cpu_int8_matmul
from paged_backend.model.quantized.checkpoint_formats import QuantizedWeight
from paged_backend.model.quantized.checkpoint_layers import CODES_KERNEL_ROWS, DequantizingLinear

pytestmark = pytest.mark.skipif(cpu_int8_matmul.library() is None, reason="no C compiler on this machine")


def codes_of(kind: torch.dtype, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    if kind == torch.float8_e4m3fn:
        return (torch.randn(*shape, generator=generator) * 40).clamp(-448, 448).to(kind)
    low, high = (-128, 128) if kind == torch.int8 else (0, 256)
    return torch.randint(low, high, shape, generator=generator, dtype=kind)


def dequantized(codes, scales, zeros, group_size) -> torch.Tensor:
    in_features = codes.shape[1]
    weight = codes.double()
    if zeros is not None:
        weight = weight - zeros.double().repeat_interleave(group_size, 1)[:, :in_features]
    return weight * scales.double().repeat_interleave(group_size, 1)[:, :in_features]


@pytest.mark.parametrize("kind", [torch.int8, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape, group_size", [((96, 576), 32), ((40, 200), 64), ((33, 100), 100), ((16, 7), 16)])
@pytest.mark.parametrize("with_zeros", [False, True])
@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (3, torch.bfloat16), (9, torch.float32)])
def test_products_equal_the_product_with_the_dequantized_weight(kind, shape, group_size, with_zeros, rows, dtype):
    generator = torch.Generator().manual_seed(shape[1] + rows)
    groups = -(-shape[1] // group_size)
    codes = codes_of(kind, shape, generator)
    scales = torch.rand(shape[0], groups, generator=generator) * 0.01 + 1e-4
    zeros = torch.randint(0, 256, (shape[0], groups), generator=generator).float() if with_zeros else None
    x = torch.randn(rows, shape[1], generator=generator).to(dtype)
    assert cpu_int8_matmul.serves_codes(x, codes)
    got = cpu_int8_matmul.codes_matmul(x, codes, scales, zeros, group_size)
    expected = x.double() @ dequantized(codes, scales, zeros, group_size).T
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    for r in range(rows):  # each row's sums in the same order, whatever else is in the call
        assert torch.equal(got[r], cpu_int8_matmul.codes_matmul(x[r:r + 1], codes, scales, zeros, group_size)[0])


def test_every_fp8_byte_reads_as_torchs_conversion():
    """All 256 bytes, through the vector widening (8 or 16 at a time) and the scalar tail, but e4m3fn's two NaNs."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(codes.float())
    codes = codes[finite].view(1, -1)  # 254 inputs: 15 full vectors of 16 (31 of 8) and a scalar tail
    values = codes.float()[0]
    for i in range(codes.shape[1]):
        one_hot = torch.zeros(1, codes.shape[1])
        one_hot[0, i] = 1.0
        got = cpu_int8_matmul.codes_matmul(one_hot, codes, torch.ones(1, 1), None, codes.shape[1])
        assert got.item() == values[i].item(), i


def test_what_it_does_not_take_is_left_to_the_rebuilt_weight():
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    assert not cpu_int8_matmul.serves_codes(torch.randn(0, 32), codes)
    assert not cpu_int8_matmul.serves_codes(torch.randn(1, 32, dtype=torch.float16), codes)
    assert not cpu_int8_matmul.serves_codes(torch.randn(1, 32), codes.to(torch.int16))
    assert not cpu_int8_matmul.serves_codes(torch.randn(1, 32), torch.zeros(4, 32).to(torch.float8_e5m2))
    with cpu_int8_matmul.switched_off():
        assert not cpu_int8_matmul.serves_codes(torch.randn(1, 32), codes)


def layer_and_weight() -> tuple[DequantizingLinear, tuple]:
    """A GPTQ-style 8-bit layer (uint8 codes, zero points, groups of 32, a short last group) and its parts."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 80), generator=generator, dtype=torch.int16)
    scales, zeros = torch.rand(64, 3, generator=generator) * 0.01, torch.full((64, 3), 128.0)
    layer = DequantizingLinear(QuantizedWeight(codes, scales, zeros, 32, 8), None, torch.float32)
    return layer, (layer.codes, layer.scales, layer.zeros, 32)


def assert_takes_the_kernel_for_small_steps_only(layer: DequantizingLinear, parts: tuple) -> None:
    """Up to CODES_KERNEL_ROWS rows the kernel's products exactly, past them the rebuilt weight's."""
    for rows in (1, 5, CODES_KERNEL_ROWS):
        x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(layer(x), cpu_int8_matmul.codes_matmul(x, *parts)), rows
        assert torch.equal(layer(x.bfloat16()), cpu_int8_matmul.codes_matmul(x.bfloat16(), *parts).bfloat16()), rows
    x = torch.randn(CODES_KERNEL_ROWS + 1, 80, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, cpu_int8_matmul.dequantize_codes(*parts)))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="needs a C++ compiler")
def test_a_checkpoint_layer_takes_the_kernel_for_small_steps_only_through_the_cpp_op():
    assert cpu_int8_matmul.CODES_OP.language == "C++"
    assert_takes_the_kernel_for_small_steps_only(*layer_and_weight())


def test_without_a_cpp_compiler_the_op_runs_its_python_kernel(tmp_path):
    script = """
import sys
sys.path.insert(0, %r)
from paged_backend.kernels import cpu_int8_matmul as k
from test_cpu_codes_matmul import assert_takes_the_kernel_for_small_steps_only, layer_and_weight
assert k.library() is not None and k.CODES_OP.language == "Python", k.CODES_OP.language
assert_takes_the_kernel_for_small_steps_only(*layer_and_weight())
""" % str(Path(__file__).parent)
    env = {**os.environ, "CXX": "/bin/false", "PAGED_BACKEND_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "the CPU op cpu_codes_op.cpp could not be built" in run.stderr
