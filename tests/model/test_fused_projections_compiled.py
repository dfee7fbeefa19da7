"""Fused projections in compiled steps: a traced forward holds one matmul per group, and compiled engines give
the unfused engine's tokens without recompiling, dense and int4."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers.engine import (
    check_against_hf,
    greedy,
    hf_case,
    mixed_prompts,
    one_thread,
    run_to_completion,
)
from helpers.models import build, int4_llama
from torch._dynamo.utils import counters

from paged_backend.model.paged.step_context import StepContext, step_context
from paged_backend import Engine, EngineConfig
from paged_backend.kernels import cpu_int4_matmul
from paged_backend.model.compiled.compilation import CompiledForward
from paged_backend.model.quantized.fused_projections import fuse_projections, groups_of

__all__ = ["one_thread"]

# Slow tier: compiles models; `-m "not slow"` leaves it out (CI runs it).
pytestmark = pytest.mark.slow

MAX_NEW = 8
CONFIG = {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 24}


def traced_calls(model, fused: bool) -> Counter:
    """The functions a dynamo trace of one forward of `model` calls, by name, fused or not."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    forward = torch.compile(lambda ids: model(ids).logits, backend=backend, fullgraph=True)
    with torch.inference_mode(), step_context(StepContext(None, torch.empty(0), fused=fused)):
        forward(torch.tensor([[1, 2, 3]]))
    return Counter(getattr(n.target, "__name__", str(n.target)) for n in graphs[0].graph.nodes
                   if n.op == "call_function")


def test_a_traced_forward_holds_one_matmul_per_group():
    """What a compiled step runs: one int4 kernel call per group (and per o/down projection), not per projection."""
    model = int4_llama()
    fuse_projections(model)
    # The int4 kernel as a traced graph calls it (int4_linear.Int4Linear.quantized_matmul): the compiled
    # kernel's op where it is built, else torch's.
    kernel = "int4_matmul.default" if cpu_int4_matmul.library() is not None else "int4mm_packed_weight_cpu"
    assert traced_calls(model, fused=False)[kernel] == 2 * 7
    assert traced_calls(model, fused=True)[kernel] == 2 * 4
    with cpu_int4_matmul.switched_off():
        assert traced_calls(model, fused=True)["int4mm_packed_weight_cpu"] == 2 * 4


def tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    return [finals[i].outputs[0].token_ids for i in ids]


def test_compiled_fused_llama_equals_hf_without_recompiling():
    _, model, prompts, refs = hf_case("llama", build("llama", seed=2), MAX_NEW)
    engine = check_against_hf(model, prompts, refs, EngineConfig(compile=True, **CONFIG), MAX_NEW, late_from=6)
    assert engine.runner.compiled and engine.runner.fused and len(groups_of(model)) == 4
    graphs = counters["stats"]["unique_graphs"]
    check_against_hf(model, prompts, refs, EngineConfig(compile=True, **CONFIG), MAX_NEW)  # a second engine
    assert counters["stats"]["unique_graphs"] == graphs and engine.runner.forward_model.eager_steps == 0


def test_compiled_fused_int4_equals_the_unfused_engines():
    model = int4_llama()
    prompts = mixed_prompts(6)  # long prompts: the graph past the int4 rows runs on the stacked dense copies
    unfused = tokens(Engine(model, None, EngineConfig(compile=False, fuse_projections=False, **CONFIG)), prompts)
    before = CompiledForward.all_eager_steps
    fused = Engine(model, None, EngineConfig(compile=True, **CONFIG))
    assert fused.runner.compiled and fused.runner.fused
    assert tokens(fused, prompts) == unfused
    compiled_unfused = Engine(model, None, EngineConfig(compile=True, fuse_projections=False, **CONFIG))
    assert tokens(compiled_unfused, prompts) == unfused  # its own graphs (the key says fused or not)
    assert compiled_unfused.runner.forward_model.graphs is not fused.runner.forward_model.graphs
    assert CompiledForward.all_eager_steps == before
