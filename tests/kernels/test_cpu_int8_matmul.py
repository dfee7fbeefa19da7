"""The compiled CPU int8 matmul (kernels/cpu_int8_matmul.py): rows times int8 codes with a bf16 scale per output
row equal the fp32 product of the rows and the dequantized weight, for a few rows (one pass over the codes) and
many (through its panel), both row dtypes, and each row's outputs are the same whatever rows share its call;
it leaves what it does not take to torch's kernel; the int8 head gives the same logits
through it as through torch's kernel, to within bf16 rounding of the rows. The same kernel multiplies rows by an
fp16 or bf16 weight (`half_matmul`): the fp32 product with the weight's exact values, a row's outputs the same
whatever rows share its call."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kernels import cpu_int8_matmul
from paged_backend.model.quantized.int8_linear import Int8Linear

pytestmark = pytest.mark.skipif(cpu_int8_matmul.library() is None, reason="no C compiler on this machine")


def weight(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=g) * 0.01 + 1e-4).bfloat16()
    return codes, scales


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1000, 576), (37, 100), (16, 1)])
def test_products_equal_the_fp32_product_with_the_dequantized_weight(rows: int, dtype: torch.dtype,
                                                                     shape: tuple[int, int]) -> None:
    codes, scales = weight(*shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    assert cpu_int8_matmul.serves(x, codes, scales)
    got = cpu_int8_matmul.int8_matmul(x, codes, scales)
    expected = x.double() @ (codes.double() * scales.double()[:, None]).T
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


@pytest.mark.parametrize("shape", [(1000, 576), (37, 100)])
def test_a_rows_outputs_are_the_same_alone_and_among_many(shape: tuple[int, int]) -> None:
    """Past MOST_ROWS the rows go through the panel, in blocks of three: each output is still the sum the
    one-pass path makes, in the same order, so batching never changes a row's logits."""
    codes, scales = weight(*shape)
    x = torch.randn(11, shape[1], generator=torch.Generator().manual_seed(2))
    together = cpu_int8_matmul.int8_matmul(x, codes, scales)
    for r in range(x.shape[0]):
        assert torch.equal(together[r], cpu_int8_matmul.int8_matmul(x[r:r + 1], codes, scales)[0]), r


def test_what_it_does_not_take_is_left_to_torch() -> None:
    codes, scales = weight(64, 32)
    assert not cpu_int8_matmul.serves(torch.randn(0, 32), codes, scales)
    assert not cpu_int8_matmul.serves(torch.randn(1, 32, dtype=torch.float16), codes, scales)
    assert not cpu_int8_matmul.serves(torch.randn(1, 32), codes.t().contiguous().t(), scales)
    assert not cpu_int8_matmul.serves(torch.randn(1, 32), codes, scales.float())
    with cpu_int8_matmul.switched_off():
        assert not cpu_int8_matmul.serves(torch.randn(1, 32), codes, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_head_gives_torchs_logits_through_the_kernel(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 2048, bias=False)
    head = Int8Linear.from_float(linear.to(dtype))
    rows = torch.randn(1, 576).to(dtype)
    with cpu_int8_matmul.switched_off():
        through_torch = head(rows)
    through_kernel = head(rows)
    assert through_kernel.dtype == dtype
    # torch's kernel rounds the rows (and its outputs) to bf16: the two differ by that rounding only.
    torch.testing.assert_close(through_kernel.float(), through_torch.float(), rtol=2e-2, atol=2e-2)
    weight = head.codes.float() * head.scales.float()[:, None]
    assert through_kernel.argmax() == (rows.float() @ weight.T).argmax()


tiled_kernel = pytest.mark.skipif(cpu_int8_matmul.tiled_here(torch.zeros(16, 2, dtype=torch.int8)) is None,
                                  reason="the tiled int8 kernel needs AVX512-BF16")


@tiled_kernel
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("shape", [(1024, 576), (32, 2)])
def test_tiled_products_equal_the_fp32_product_with_the_dequantized_weight(rows: int, shape: tuple[int, int]) -> None:
    codes, scales = weight(*shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    tiled = cpu_int8_matmul.tiled_here(codes)
    assert tiled is not None and cpu_int8_matmul.serves_tiled(x)
    got = cpu_int8_matmul.int8_matmul_tiled(x, tiled, scales)
    expected = x.double() @ (codes.double() * scales.double()[:, None]).T
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)
    # Each row on its own: the same numbers (a row's sum does not depend on the rows beside it).
    assert torch.equal(torch.cat([cpu_int8_matmul.int8_matmul_tiled(row[None], tiled, scales) for row in x]), got)


@tiled_kernel
def test_the_tiled_layout_puts_an_output_rows_pair_of_codes_side_by_side() -> None:
    codes, _ = weight(32, 8)
    tiled = cpu_int8_matmul.tile(codes)
    assert tiled.shape == (2, 4, 16, 2)
    assert tiled[1, 3, 5].tolist() == codes[16 + 5, 6:8].tolist()


@tiled_kernel
def test_an_int8_layer_takes_the_tiled_kernel_for_bf16_rows_up_to_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_backend.model.quantized import int8_linear

    torch.manual_seed(0)
    head = Int8Linear.from_float(torch.nn.Linear(64, 48, bias=False).bfloat16())
    assert head.tiled_codes is not None
    calls = []
    real = cpu_int8_matmul.int8_matmul_tiled
    monkeypatch.setattr(cpu_int8_matmul, "int8_matmul_tiled", lambda *a: calls.append(len(a[0])) or real(*a))
    limit = int8_linear.TILED_DENSE_ROWS
    for rows in (1, 9, limit, limit + 1):
        head(torch.randn(rows, 64).bfloat16())
    head(torch.randn(2, 64))  # fp32 rows: the fp32 paths
    assert calls == [1, 9, limit]
    with cpu_int8_matmul.switched_off():
        head(torch.randn(2, 64).bfloat16())
        assert Int8Linear.from_float(torch.nn.Linear(64, 48, bias=False).bfloat16()).tiled_codes is None
    assert calls == [1, 9, limit]


def half_weight(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    values = torch.randn(out_features, in_features, generator=g) * 0.05
    values[0, 0] = 3e-6  # an fp16 subnormal, widened exactly as the others
    return values.to(dtype)


half_dtypes = [pytest.param(torch.float16, marks=pytest.mark.skipif(
    not cpu_int8_matmul.serves_half(torch.zeros(1, 8), torch.zeros(8, 8, dtype=torch.float16)),
    reason="fp16 weights need F16C")), torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 32])
@pytest.mark.parametrize("dtype", half_dtypes)
@pytest.mark.parametrize("shape", [(1000, 576), (37, 100), (16, 1)])
def test_half_products_equal_the_fp32_product_with_the_weights_values(rows: int, dtype: torch.dtype,
                                                                      shape: tuple[int, int]) -> None:
    w = half_weight(*shape, dtype)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    assert cpu_int8_matmul.serves_half(x, w)
    got = cpu_int8_matmul.half_matmul(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-6 * shape[1] ** 0.5)
    # Each row on its own, through the one-pass path: the same numbers as among many (through the panel).
    assert torch.equal(torch.cat([cpu_int8_matmul.half_matmul(row[None], w) for row in x]), got)


def test_half_weights_it_does_not_take_are_left_to_the_caller() -> None:
    w = half_weight(64, 32, torch.bfloat16)
    assert not cpu_int8_matmul.serves_half(torch.randn(0, 32), w)
    assert not cpu_int8_matmul.serves_half(torch.randn(1, 32), w.float())
    assert not cpu_int8_matmul.serves_half(torch.randn(1, 32), w.t().contiguous().t())
    with cpu_int8_matmul.switched_off():
        assert not cpu_int8_matmul.serves_half(torch.randn(1, 32), w)
