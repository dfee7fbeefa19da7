"""Decoder layers as nested compile regions: a traced step holds one subgraph for equal layers, called once per
layer, because each layer's index reaches the attention as a tensor input, not a constant. (Torch inlines a
subgraph called once, and traces some layers apart from their kind, the first one among them: a stack of four
Llama layers makes one region called three times.)"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import transformers as tf
from helpers.engine import check_against_hf, hf_case
from helpers.models import build, build_from_config

from paged_backend import Engine, EngineConfig
from paged_backend.model.compiled import compilation, layer_regions

CONFIG = {"num_kv_blocks": 16, "block_size": 4, "max_num_batched_tokens": 16}
MAX_NEW = 10

# Stacks deep enough for layers to share a region (the first is traced apart): Gemma 2 alternates sliding-window
# and full layers, two kinds of layer, each its own region where the attention is traced into the graph.
DEEP = {
    "llama": lambda: tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2),
    "gemma2": lambda: tf.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                      query_pre_attn_scalar=16),
}


def four_layer_llama() -> tf.PreTrainedModel:
    return build_from_config(lambda: tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))


def traced_step(engine: Engine, tokens: int) -> torch.fx.GraphModule:
    """Dynamo's graph of one engine step of `tokens` tokens, its decoder layers marked as regions."""
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    runner = engine.runner
    recorded = torch.compile(compilation.logits_of, backend=record, fullgraph=True, dynamic=True)
    runner.forward_model = functools.partial(recorded, runner.model)
    with layer_regions.marked(runner.model):
        compilation.warm_up(runner._warm_up_step, runner.cache, ((tokens, 1),))
    return graphs[0]


def region_calls(graph: torch.fx.GraphModule) -> list[str]:
    """The subgraph each region call of `graph` runs, in call order."""
    return [node.args[0].target for node in graph.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph]


def region_layers(graph: torch.fx.GraphModule) -> dict[str, list[int]]:
    """The decoder layers whose weights each region of `graph` is called with."""
    layers: dict[str, list[int]] = {}
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
            names = " ".join(str(arg) for arg in node.args[2:])
            layers.setdefault(node.args[0].target, []).append(int(re.search(r"layers_modules_(\d+)_", names)[1]))
    return layers


@pytest.mark.slow  # traces a step with dynamo: the slow tier
@pytest.mark.parametrize("tokens", [1, 5])
def test_equal_layers_trace_one_region(tokens: int):
    model = four_layer_llama()
    engine = Engine(model, None, EngineConfig(compile=False, **CONFIG))
    layer_regions.index_layers(model)
    calls = region_calls(traced_step(engine, tokens))
    assert len(calls) == 3 and len(set(calls)) == 1


@pytest.mark.slow  # traces a step with dynamo: the slow tier
def test_layers_that_differ_in_their_attention_record_alone_share_a_region():
    """Gemma 2's sliding-window and full layers differ only in their attention records (the window), which the
    opaque op finds by the layer's index at run time: in a step through the op, layers of both kinds share regions."""
    model = build_from_config(DEEP["gemma2"], seed=1)
    engine = Engine(model, None, EngineConfig(compile=False, **CONFIG))
    layer_regions.index_layers(model)
    layers = region_layers(traced_step(engine, 5))
    kinds = [{model.config.layer_types[layer] for layer in members} for members in layers.values()]
    assert kinds and all(kind == {"full_attention", "sliding_attention"} for kind in kinds)


def test_no_region_mixes_kinds_of_layer_where_the_attention_is_traced(monkeypatch):
    """A one-token step attending inside the graph (torch_single_row.py) traces each layer's record (its window) into
    the graph, read from the step context as the graph is traced, with no graph break (`fullgraph`): Gemma 2's
    sliding-window and full layers trace different graphs, so no region is called by layers of both kinds."""
    model = build_from_config(DEEP["gemma2"], seed=1)
    # Every block kept: the single-row path reads one block table (model_runner.single_row).
    engine = Engine(model, None, EngineConfig(compile=False, free_window_blocks=False, **CONFIG))
    monkeypatch.setattr(type(engine.runner), "single_row", property(lambda runner: True))
    layer_regions.index_layers(model)
    layers = region_layers(traced_step(engine, 1))
    kinds = [{model.config.layer_types[layer] for layer in members} for members in layers.values()]
    assert kinds and all(len(kind) == 1 for kind in kinds)


@pytest.mark.slow  # traces a step with dynamo: the slow tier
def test_without_index_tensors_each_layer_is_its_own_region():
    """The control: with the index as an int, it is a constant of each layer's graph, no two are equal, and each
    subgraph, called once, is inlined."""
    engine = Engine(four_layer_llama(), None, EngineConfig(compile=False, **CONFIG))
    assert region_calls(traced_step(engine, 5)) == []


def test_the_decoder_stack_is_found_and_restored():
    model = build("llama")
    layers = layer_regions.decoder_layers(model)
    assert layers == list(model.model.layers)
    with layer_regions.marked(model):
        assert all(isinstance(layer.forward, functools.partial) for layer in layers)
    assert all("forward" not in vars(layer) for layer in layers)


def test_index_tensors_hold_each_module_s_layer():
    model = four_layer_llama()
    layer_regions.index_layers(model)
    attentions = [layer.self_attn for layer in model.model.layers]
    assert [int(getattr(a, layer_regions.LAYER_TENSOR)) for a in attentions] == [0, 1, 2, 3]
    assert [layer_regions.traced_layer(a) for a in attentions] == [0, 1, 2, 3]  # eagerly, the int


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(DEEP))
def test_compiled_regions_give_hf_s_tokens(arch: str, monkeypatch):
    """Compiled with its layers as regions, a mixed batch (chunked, joined late) and a lone stream (one-token
    steps attending inside the graph) give HF generate's tokens."""
    marked = []
    original = layer_regions.marked

    def spy(model):
        marked.append(len(layer_regions.decoder_layers(model)))
        return original(model)

    monkeypatch.setattr(layer_regions, "marked", spy)
    _, model, prompts, refs = hf_case(arch, build_from_config(DEEP[arch], seed=1), MAX_NEW)
    config = EngineConfig(compile=True, num_kv_blocks=40, block_size=4, max_num_batched_tokens=24)
    engine = check_against_hf(model, prompts, refs, config, MAX_NEW, late_from=6)
    assert engine.runner.compiled and engine.runner.forward_model.eager_steps == 0
    assert marked and set(marked) == {model.config.num_hidden_layers}  # every graph traced with regions
    check_against_hf(model, prompts[:1], refs[:1], config, MAX_NEW)
