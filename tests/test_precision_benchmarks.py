"""Smoke tests of the precision benchmarks: benchmarks/quality.py on a tiny random model (fp32 is its own
reference, the other variants report their differences to it), and benchmarks/cpu_vs_llamacpp.py's
clean skip without llama-cpp-python and llama.cpp without its extra buffer types on an AMX CPU."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from helpers.engine import mixed_prompts
from helpers.models import build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_vs_llamacpp  # noqa: E402
import quality  # noqa: E402


def test_quality_report(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    build("llama").save_pretrained(tmp_path / "tiny")
    report = quality.run_quality(str(tmp_path / "tiny"), mixed_prompts(3), ["kv_int8", "int8"], max_tokens=6,
                                 speed_tokens=4, repeats=1, num_kv_blocks=64)
    assert list(report) == ["fp32", "kv_int8", "int8"]
    fp32 = report["fp32"]
    assert fp32["mean_abs_dlogprob"] == 0 and fp32["agreement"] == 1 and fp32["identical_prefix_mean"] == 6
    # fp32's teacher-forced top tokens are its own greedy answer, position by position.
    assert fp32["teacher_forced_agreement"] == 1
    assert report["kv_int8"]["kv_cache_dtype"] == "torch.int8" and report["int8"]["dtype"] == "torch.float32"
    for name in ("kv_int8", "int8"):
        assert 0 < report[name]["mean_abs_dlogprob"] < 0.5 and 0 <= report[name]["agreement"] <= 1
        assert 0 <= report[name]["teacher_forced_agreement"] <= 1
        assert report[name]["tokens_per_s"] > 0


def test_llamacpp_comparison_says_how_to_install_when_missing(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert cpu_vs_llamacpp.main(["--repeats", "1"]) is None
    assert "pip install 'paged-backend[compare]'" in capsys.readouterr().out


def test_engine_options_parse_into_llm_keywords() -> None:
    assert cpu_vs_llamacpp.parse_engine_options("dtype=float32,quantization=int8,compile=false") == {
        "dtype": "float32", "quantization": "int8", "compile": False}
    assert cpu_vs_llamacpp.parse_engine_options("") == {}


def test_llama_cpp_runs_without_extra_buffers_on_an_amx_cpu(monkeypatch) -> None:
    flags = {"avx512f amx_int8 amx_tile": False, "avx2 avx512f avx512_bf16": True}
    for text, safe in flags.items():
        monkeypatch.setattr(cpu_vs_llamacpp.Path, "read_text", lambda self, text=text: f"flags : {text}\n")
        assert cpu_vs_llamacpp.extra_buffers_safe() is safe
    monkeypatch.undo()
    # Loading without them turns llama.cpp's use_extra_bufts off for that load only.
    low = types.ModuleType("llama_cpp.llama_cpp")
    low.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)
    package = types.ModuleType("llama_cpp")
    package.llama_cpp = low
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", low)
    with cpu_vs_llamacpp.without_extra_buffers():
        assert low.llama_model_default_params().use_extra_bufts is False
    assert low.llama_model_default_params().use_extra_bufts is True
