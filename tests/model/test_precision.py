"""The weight dtype picked when none is named (precision.py): bf16 only on a CPU that computes it natively,
read from the CPU flags; and the default model in bf16 still passes the engine's load-time self-check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import build

from paged_backend.model.loading import precision
from paged_backend.model.loading.model_loader import load_model

ORIGINAL_CHECK = precision.cpu_has_native_bf16  # conftest pins it to False for the rest of the suite

FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbogomips\t: 4890\n"


@pytest.mark.parametrize("extra, native", [("avx512_bf16 avx512_vnni", True), ("amx_bf16", True),
                                           ("avx512_vnni", False), ("", False)])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str,
                                                native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(FLAGS.format(extra=extra))
    monkeypatch.delenv(precision.NATIVE_BF16_ENV, raising=False)  # conftest sets it for the whole suite
    monkeypatch.setattr(precision, "CPUINFO", cpuinfo)
    ORIGINAL_CHECK.cache_clear()
    try:
        assert ORIGINAL_CHECK() is native
        monkeypatch.setattr(precision, "CPUINFO", tmp_path / "missing")
        ORIGINAL_CHECK.cache_clear()
        assert ORIGINAL_CHECK() is False  # no /proc/cpuinfo (not Linux): fp32, the safe choice
    finally:
        ORIGINAL_CHECK.cache_clear()


@pytest.mark.parametrize("value, native", [("1", True), ("0", False)])
def test_the_environment_overrides_the_cpu_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
                                                 native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(FLAGS.format(extra="" if native else "avx512_bf16"))  # the flags say the opposite
    monkeypatch.setattr(precision, "CPUINFO", cpuinfo)
    monkeypatch.setenv(precision.NATIVE_BF16_ENV, value)
    ORIGINAL_CHECK.cache_clear()
    try:
        assert ORIGINAL_CHECK() is native
    finally:
        ORIGINAL_CHECK.cache_clear()


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_and_default_pick_by_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool,
                                          expected: torch.dtype) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    build("llama").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # a bf16 checkpoint
    for dtype in (None, "auto"):
        model, _ = load_model(tmp_path / "bf16", dtype=dtype, device="cpu")
        assert model.dtype == expected
    assert precision.preferred_dtype(torch.device("cpu"))[0] == expected
    model, _ = load_model(tmp_path / "bf16", dtype="float32", device="cpu")  # a named dtype always wins
    assert model.dtype == torch.float32


def test_adopted_model_is_converted_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    model = build("llama")
    assert load_model(model)[0].dtype == torch.float32  # None: a loaded model is used as it is
    assert load_model(model, dtype="auto")[0].dtype == torch.bfloat16


@pytest.mark.slow
def test_default_model_in_bf16_passes_the_self_check() -> None:
    from paged_backend import LLM, SamplingParams

    # The self-check runs at start-up (on by default); quantization=None keeps bf16 weights (not auto's int4).
    llm = LLM(None, dtype="bfloat16", quantization=None, num_kv_blocks=64)
    assert llm.model.dtype == torch.bfloat16
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
