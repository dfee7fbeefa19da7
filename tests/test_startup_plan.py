"""The start-up plan decides every start-up choice from the config and the model's facts, in one place: a table of
combinations, each with the choices and the reasons it must give; then one engine built from its plan."""

from __future__ import annotations

import pytest
import torch
from helpers.models import build

from paged_backend import Engine, EngineConfig
from paged_backend.config import DEFAULT_CPU_KV_BYTES
from paged_backend.model.compiled import compilation, cuda_graphs
from paged_backend.core.layer_specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, StateSpec
from paged_backend.model.paged.paged_cache import KVShape, uniform_shape
from paged_backend.startup_plan import ModelFacts, plan_startup

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
FULL, WINDOW = FullAttentionSpec(), SlidingWindowSpec(32)
SHAPE = uniform_shape(4, num_kv_heads=2, head_dim=64)
WINDOWED = KVShape(num_kv_heads=2, head_dim=64, layers=(WINDOW, FULL, WINDOW, FULL))
HYBRID = KVShape(num_kv_heads=2, head_dim=64, layers=(RecurrentStateSpec((StateSpec((8, 4)),)), FULL) * 2)
TP = "tensor parallelism runs eagerly (its collectives are inside the forward)"
BLOCKS = 64

# (case, config, facts, expected choices; "topics": the notes' topics in order)
CASES = [
    ("cpu", {}, {}, dict(pad=False, capture=False, frees=False, cache_pages=BLOCKS, null_block=None,
                         compile=True, prefix_caching=True, max_model_len=BLOCKS * 16, topics=[])),
    ("cpu, eager by config", {"compile": False}, {}, dict(compile=False, topics=[])),
    ("cpu, padded on request", {"pad_decode": True}, {},
     dict(pad=True, capture=False, cache_pages=BLOCKS + 1, graph_refusal="CUDA graphs need a CUDA device")),
    ("windows free their blocks", {}, {"shape": WINDOWED},
     dict(frees=True, num_blocks=BLOCKS * 2, cache_pages=BLOCKS * 2 + 1, null_block=BLOCKS * 2, topics=[])),  # pages of 2 layers
    ("windows, free_window_blocks off", {"free_window_blocks": False}, {"shape": WINDOWED},
     dict(frees=False, cache_pages=BLOCKS, topics=["sliding windows"])),
    ("windows, a draft model", {}, {"shape": WINDOWED, "draft_shape": SHAPE, "draft_positions": 100},
     dict(frees=False, max_model_len=100, topics=["sliding windows"])),
    ("windows, tensor parallel", {}, {"shape": WINDOWED, "tensor_parallel_reason": TP},
     dict(frees=False, tensor_parallel=True, compile=False, topics=["sliding windows", "compile"])),
    ("windows, padded", {"pad_decode": True}, {"shape": WINDOWED}, dict(frees=False, pad=True,
                                                                         topics=["sliding windows"])),
    ("cuda", {}, {"device": CUDA}, dict(pad=True, capture=True, graph_refusal=None, compile=False, topics=[])),
    ("cuda, windows", {}, {"device": CUDA, "shape": WINDOWED}, dict(capture=True, frees=False,
                                                                     topics=["sliding windows"])),
    ("cuda, padding off", {"pad_decode": False}, {"device": CUDA}, dict(pad=False, capture=False)),
    ("cuda, LoRA", {"enable_lora": True}, {"device": CUDA}, dict(pad=False, capture=False, lora=True,
                                                                  topics=["CUDA graphs"])),
    ("cuda, tensor parallel", {}, {"device": CUDA, "tensor_parallel_reason": TP},
     dict(pad=False, capture=False, topics=["CUDA graphs"])),
    ("cuda, head size Triton cannot serve", {}, {"device": CUDA, "shape": uniform_shape(4, 2, 1024)},
     dict(pad=False, topics=["CUDA graphs"])),
    ("cuda, padded though uncaptured", {"pad_decode": True, "enable_lora": False},
     {"device": CUDA, "tensor_parallel_reason": TP}, dict(pad=True, capture=False)),
    ("a hybrid model", {"pad_decode": True}, {"shape": HYBRID}, dict(prefix_caching=False, pad=False)),
    ("prefix caching off", {"enable_prefix_caching": False}, {}, dict(prefix_caching=False)),
    ("a model that runs eagerly", {}, {"model_eager_reason": "PEFT tuner layers"},
     dict(compile=False, topics=["compile"])),
    ("a context limit", {}, {"context_limit": (100, "LongRoPE's original length"), "positions": 4096},
     dict(max_model_len=100, context_note=" (LongRoPE's original length)")),
    ("positions below the cache", {}, {"positions": 300}, dict(max_model_len=300, context_note="")),
    ("the cache below the positions", {"num_kv_blocks": 4}, {"positions": 4096}, dict(max_model_len=64)),
    ("a budget in bytes", {"num_kv_blocks": None, "kv_cache_bytes": 2**20}, {},
     dict(num_blocks=2**20 // SHAPE.bytes_per_block(16, torch.float32))),
    ("a budget shared with a draft", {"num_kv_blocks": None, "kv_cache_bytes": 2**20}, {"draft_shape": SHAPE},
     dict(num_blocks=2**20 // (2 * SHAPE.bytes_per_block(16, torch.float32)))),
    ("the default CPU budget", {"num_kv_blocks": None}, {},
     dict(num_blocks=DEFAULT_CPU_KV_BYTES // SHAPE.bytes_per_block(16, torch.float32))),
    ("a CUDA budget from free memory", {"num_kv_blocks": None}, {"device": CUDA, "free_device_bytes": 10 * 2**20},
     dict(num_blocks=4 * 2**20 // SHAPE.bytes_per_block(16, torch.float32))),
]


def facts(**values) -> ModelFacts:
    return ModelFacts(**{"device": CPU, "dtype": torch.float32, "shape": SHAPE, "positions": 2**20, **values})


@pytest.fixture(autouse=True)
def triton_serves_cuda(monkeypatch) -> None:
    """Planning for a CUDA device on a machine without one: Triton serves the head sizes it compiles for; a C++
    compiler is there for CPU compiles."""
    monkeypatch.setattr(cuda_graphs, "select_backend", lambda device, dtype, head_dim:
                        "triton" if device.type == "cuda" and head_dim <= 256 else "torch")
    monkeypatch.setattr(compilation, "cpp_compiler", lambda: "g++")
    monkeypatch.delenv(compilation.ENV_COMPILE, raising=False)


@pytest.mark.parametrize(("config", "given", "expected"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_the_plan_for_each_combination(config, given, expected) -> None:
    plan = plan_startup(EngineConfig(**{"num_kv_blocks": BLOCKS, **config}), facts(**given))
    derived = {"frees": plan.groups.frees_blocks, "topics": [topic for topic, _ in plan.notes]}
    found = {name: derived[name] if name in derived else getattr(plan, name) for name in expected}
    assert found == expected


def test_every_note_says_why() -> None:
    plan = plan_startup(EngineConfig(num_kv_blocks=BLOCKS, enable_lora=True),
                        facts(device=CUDA, shape=WINDOWED, model_eager_reason="PEFT tuner layers"))
    assert plan.reasons() == {"CUDA graphs": "LoRA steps run eagerly and unpadded"}
    plan = plan_startup(EngineConfig(num_kv_blocks=BLOCKS, compile=True),
                        facts(shape=WINDOWED, tensor_parallel_reason=TP))
    assert plan.reasons() == {"sliding windows": "every layer keeps every block (tensor parallelism's ranks share "
                                                 "one block table)", "compile": TP}


@pytest.mark.parametrize(("config", "given", "match"), [
    ({"max_model_len": 200}, {"context_limit": (100, "why")}, "max_model_len=200: why"),
    ({"max_num_batched_tokens": 64}, {"step_limit": (32, "temperature tuning")}, "max_num_batched_tokens=64"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 16}, {"step_limit": (32, "temperature tuning")},
     "max_num_seqs=64"),
    ({"enable_lora": True}, {"tensor_parallel_reason": TP}, "enable_lora=True does not run with tensor"),
])
def test_a_config_the_model_cannot_run_is_refused_by_name(config, given, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_startup(EngineConfig(num_kv_blocks=BLOCKS, **config), facts(**given))


def test_an_engine_is_built_as_its_plan_says() -> None:
    engine = Engine(build("llama"), None, EngineConfig(num_kv_blocks=8, compile=False, pad_decode=True))
    plan = engine.plan
    assert (plan.pad, plan.capture, plan.compile) == (True, False, False)
    assert engine.cache.num_blocks == plan.cache_pages == 9 and engine.kv.pool.num_blocks == plan.num_blocks == 8
    assert engine.runner.padding is not None and engine.runner.padding.scratch_block == 8
    assert engine.max_model_len == plan.max_model_len == 8 * 16
    stats = engine.stats()
    assert (stats["startup_pad_decode"], stats["startup_compile_planned"], stats["startup_max_model_len"]) == \
        (1.0, 0.0, 128)
