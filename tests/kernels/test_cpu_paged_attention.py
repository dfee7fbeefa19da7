"""The compiled CPU paged-attention kernel: the same output as the PyTorch ops it replaces, for every option a
layer may carry, and a machine without a compiler still served by those ops."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.kernels import make_batch
from helpers.tolerances import tolerance
from paged_backend.kernels import (
    LayerAttention,
    LayerCache,
    PagedCaches,
    cpu_paged_attention,
    paged_attention,
    torch_attention,
)
from paged_backend.kernels.kv_quant import quantize_int8

# Decode rows over short and long contexts, rows verifying proposals, a chunk of exactly MOST_ROWS rows after
# a context, a fresh prompt of a few rows, a 20-row chunk and a 40-row prompt in short sequences (the kernel's
# too, whatever their rows), and a 20-row chunk and a 140-row prompt longer than SHORT_SEQUENCE, left to SDPA.
QUERY_LENS = [1, 1, 1, 1, 4, 2, 16, 5, 20, 40, 20, 140]
SEQ_LENS = [1, 30, 77, 400, 34, 36, 60, 5, 61, 40, 200, 140]

pytestmark = pytest.mark.skipif(cpu_paged_attention.library() is None, reason="no C compiler on this machine")


def caches(batch, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None) -> PagedCaches:
    return PagedCaches(batch.key_cache, batch.value_cache, key_scales, value_scales)


def by_torch_ops(batch, scale: float, key_scales: torch.Tensor | None = None,
                 value_scales: torch.Tensor | None = None, **options) -> torch.Tensor:
    """paged_attention() in PyTorch ops, with a fresh step memo."""
    fresh = dataclasses.replace(batch.metadata, derived={})
    with cpu_paged_attention.switched_off():
        return paged_attention(batch.query, caches(batch, key_scales, value_scales), fresh,
                               LayerAttention(scale, **options))


def by_kernel(batch, scale: float, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
              **options) -> torch.Tensor:
    metadata = dataclasses.replace(batch.metadata, derived={})
    out = paged_attention(batch.query, caches(batch, key_scales, value_scales), metadata,
                          LayerAttention(scale, **options))
    few, many = metadata.derived["cpu_kernel_sequences"]  # the kernel took the step (bf16: its decode rows)
    most = cpu_paged_attention.MOST_ROWS if batch.query.dtype == torch.float32 else 1
    assert few.tolist() == [i for i, (n, length) in enumerate(zip(QUERY_LENS, SEQ_LENS))
                            if n <= most or length <= cpu_paged_attention.SHORT_SEQUENCE]
    assert many == [10, 11]
    return out


OPTIONS = {
    "plain": {},
    "window": {"window": 7},
    "chunk": {"chunk": 24},
    "softcap": {"softcap": 5.0},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625])},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 9.0, -3.0])},
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch_ops(option: str, dtype: torch.dtype) -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=3, head_dim=64, block_size=16, dtype=dtype)
    got = by_kernel(batch, 0.125, **OPTIONS[option])
    want = by_torch_ops(batch, 0.125, **OPTIONS[option])
    assert got.dtype == dtype and torch.isfinite(got).all()  # unwritten slots hold NaN: never read
    torch.testing.assert_close(got, want, **tolerance(dtype, "kernel"))


@pytest.mark.parametrize(("head_dim", "block_size", "group"), [(80, 8, 1), (128, 32, 4), (16, 4, 2), (576, 16, 16)])
def test_kernel_takes_any_head_size_block_size_and_group(head_dim: int, block_size: int, group: int) -> None:
    """Head sizes that are no whole number of vector lanes (80), blocks smaller and larger than a chunk of
    keys, multi-query groups and a latent attention's 576-wide rows."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=1, group=group, head_dim=head_dim, block_size=block_size)
    scale = head_dim ** -0.5
    torch.testing.assert_close(by_kernel(batch, scale, window=50), by_torch_ops(batch, scale, window=50),
                               **tolerance(torch.float32, "kernel"))


@pytest.mark.parametrize(("head_dim", "block_size", "group"), [(64, 16, 3), (128, 8, 8), (96, 32, 1), (80, 16, 2)])
def test_bf16_decode_rows_over_a_bf16_cache(head_dim: int, block_size: int, group: int) -> None:
    """A bf16 model's decode rows: with AVX512-BF16, keys multiplied in bf16 pairs and scored 16 at a time
    (rows in tiles of 4, so a group of 8 takes two); head sizes of no whole 32 (80) take the generic path.
    Contexts from 1 to 400 keys, some ending inside a chunk, many crossing the running max's rescaling."""
    lens = [1, 17, 30, 77, 400, 129, 16, 33]
    batch = make_batch([1] * len(lens), lens, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                       dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    metadata = dataclasses.replace(batch.metadata, derived={})
    got = paged_attention(batch.query, caches(batch), metadata, LayerAttention(scale))
    assert len(metadata.derived["cpu_kernel_sequences"][0]) == len(lens)  # every sequence in the kernel
    torch.testing.assert_close(got, by_torch_ops(batch, scale), **tolerance(torch.bfloat16, "kernel"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_call_stores_the_steps_rows_before_it_reads(dtype: torch.dtype) -> None:
    """A layer's write and attention as the engine calls them: the step's new K/V (as a model hands them over,
    the key its own tensor and the value a slice of a fused projection's output) go into the cache inside the
    kernel's call, before the kernel's sequences and those left to SDPA read it. The cache ends as the PyTorch
    write leaves it."""
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=3, head_dim=64, dtype=dtype)
    # The key its own tensor (rotated), the value a slice of the fused projection's output: strides differ.
    key = batch.new_key.contiguous()
    value = torch.cat([batch.new_value, batch.new_key, batch.new_value], dim=1)[:, 2:4]
    forgotten = torch.stack([batch.key_cache, batch.value_cache])
    forgotten[:, :, batch.metadata.slot_mapping] = float("nan")  # the new tokens' slots, unwritten

    def write_and_attend(layer_cache: torch.Tensor) -> torch.Tensor:
        metadata = dataclasses.replace(batch.metadata, derived={})
        return torch_attention.write_and_attend(batch.query, key, value, LayerCache(layer_cache), metadata,
                                                LayerAttention(0.125))

    by_kernel_cache, by_torch_cache = forgotten.clone(), forgotten.clone()
    got = write_and_attend(by_kernel_cache)
    with cpu_paged_attention.switched_off():
        want = write_and_attend(by_torch_cache)
    assert cpu_paged_attention.stores(key, value, by_kernel_cache[0], batch.metadata.slot_mapping)
    torch.testing.assert_close(by_kernel_cache, by_torch_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got, want, **tolerance(dtype, "kernel"))


def test_the_kernels_call_skips_a_padding_row() -> None:
    """A row past the step's sequences with slot -1 (a padded decode step) is not stored: a store at slot -1
    would land in the row before each head's slots (the guard row, or the previous head's last slot)."""
    batch = make_batch([1, 1, 1], [30, 77, 5], num_kv_heads=2, group=3, head_dim=64, dtype=torch.bfloat16)
    pad = lambda rows: torch.cat([rows, rows[:1] + 100])  # noqa: E731
    query, key, value = pad(batch.query.contiguous()), pad(batch.new_key), pad(batch.new_value)
    metadata = dataclasses.replace(batch.metadata, slot_mapping=torch.cat([batch.metadata.slot_mapping,
                                                                          torch.tensor([-1])]), derived={})
    cache = torch.stack([batch.key_cache, batch.value_cache])
    memory = torch.full((64 + cache.numel(),), float("nan"), dtype=cache.dtype)  # a guard row, then the cache
    layer_cache = memory[64:].view(cache.shape)
    layer_cache.copy_(cache)
    got = torch_attention.write_and_attend(query, key, value, LayerCache(layer_cache), metadata, LayerAttention(0.125))
    assert "cpu_kernel_step" in metadata.derived  # the kernel took the step
    assert torch.isnan(memory[:64]).all()
    torch.testing.assert_close(layer_cache, cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got[:3], by_torch_ops(batch, 0.125), **tolerance(torch.bfloat16, "kernel"))


def test_int8_cache_is_dequantized_by_its_scales() -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=3, head_dim=64)
    (key_codes, key_scales), (value_codes, value_scales) = (
        quantize_int8(torch.nan_to_num(c)) for c in (batch.key_cache, batch.value_cache))
    quantized = dataclasses.replace(batch, key_cache=key_codes, value_cache=value_codes)
    scales = {"key_scales": key_scales, "value_scales": value_scales}
    torch.testing.assert_close(by_kernel(quantized, 0.125, **scales), by_torch_ops(quantized, 0.125, **scales),
                               **tolerance(torch.float32, "kernel"))


def test_a_bf16_query_over_an_fp32_cache() -> None:
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=3, head_dim=64)
    mixed = dataclasses.replace(batch, query=batch.query.to(torch.bfloat16))
    got = by_kernel(mixed, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, by_torch_ops(mixed, 0.125), **tolerance(torch.bfloat16, "kernel"))


def test_fp16_stays_on_torch_ops() -> None:
    batch = make_batch([1, 1], [10, 20], head_dim=64, dtype=torch.float16)
    paged_attention(batch.query, caches(batch), batch.metadata, LayerAttention(0.125))
    assert "cpu_kernel_sequences" not in batch.metadata.derived


@pytest.fixture
def fresh_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The kernel library looked up again, under an empty cache folder; the process's own one restored after."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    cpu_paged_attention.library.cache_clear()
    yield tmp_path
    cpu_paged_attention.library.cache_clear()


def test_the_library_is_built_once_and_kept(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_paged_attention.library() is not None
    kept = list((fresh_library / "cache" / "kernels").glob("cpu_paged_attention-*.so"))
    assert len(kept) == 1 and not list(kept[0].parent.glob("*.tmp"))

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    cpu_paged_attention.library.cache_clear()
    assert cpu_paged_attention.library() is not None


def test_an_unwritable_cache_folder_builds_in_a_temporary_one(fresh_library: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    (fresh_library / "cache").mkdir()
    (fresh_library / "cache").chmod(0o500)
    try:
        assert cpu_paged_attention.library() is not None
    finally:
        (fresh_library / "cache").chmod(0o700)


def test_without_a_compiler_attention_runs_in_torch_ops(fresh_library: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", str(fresh_library / "no-such-compiler"))
    with caplog.at_level(logging.WARNING):
        assert cpu_paged_attention.library() is None
    assert "could not be built" in caplog.text and "PyTorch ops" in caplog.text
    batch = make_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=3, head_dim=64)
    got = paged_attention(batch.query, caches(batch), batch.metadata, LayerAttention(0.125))
    assert "cpu_kernel_sequences" not in batch.metadata.derived and torch.isfinite(got).all()


def test_a_compile_error_is_said_with_the_compilers_words(fresh_library: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    broken = fresh_library / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_paged_attention, "SOURCE", broken)
    with caplog.at_level(logging.WARNING):
        assert cpu_paged_attention.library() is None
    assert "exited with" in caplog.text and "error" in caplog.text
    assert not list((fresh_library / "cache" / "kernels").glob("*"))  # no partial library left behind


def test_the_environment_switches_the_kernel_off(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_paged_attention.ENV_SWITCH, "0")
    assert cpu_paged_attention.library() is None
    assert not (fresh_library / "cache" / "kernels").exists()
