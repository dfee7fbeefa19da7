"""Each layer's attention record (kernels/layer_attention.py) is given once, by the start-up probe, from what the
layer passes its attention function, and every step's op finds it in the step context by the layer's index."""

from __future__ import annotations

import torch
from helpers.adapters import build_adapted
from helpers.models import build

from paged_backend.model.loading import model_check
from paged_backend.model.loading.model_check import prepare_model


def records(model: torch.nn.Module):
    return prepare_model(model, model.config.get_text_config().num_hidden_layers, self_check=False).attention


def test_a_window_and_a_soft_cap_are_recorded_per_layer() -> None:
    model = build("gemma2")
    layers = records(model)
    config = model.config
    assert [layer.window for layer in layers] == [config.sliding_window if kind == "sliding_attention" else None
                                                  for kind in config.layer_types]
    assert {layer.softcap for layer in layers} == {config.attn_logit_softcapping}
    assert {layer.scale for layer in layers} == {config.query_pre_attn_scalar ** -0.5}


def test_sinks_are_the_layer_s_own_parameter() -> None:
    """The record holds the model's tensor, not a copy: new weights loaded in place reach the kernels."""
    model = build("gpt_oss")
    layers = records(model)
    assert all(layer.sinks is block.self_attn.sinks for layer, block in zip(layers, model.model.layers))


def test_a_chunk_is_recorded_on_chunked_layers_only() -> None:
    model = build("llama4_text")
    config = model.config
    assert [layer.chunk for layer in records(model)] == [
        config.attention_chunk_size if kind == "chunked_attention" else None for kind in config.layer_types]


def test_an_adapter_records_its_alibi_slopes() -> None:
    model = build_adapted("bloom")
    layers = records(model)
    assert all(layer.alibi_slopes is block.self_attention._paged_alibi_slopes
               for layer, block in zip(layers, model.transformer.h))


def test_the_self_check_records_its_shrunk_window_and_chunk() -> None:
    """The self-check crosses a real model's window and chunk with short sequences: its paged steps attend with
    records probed under the shrunk settings, while the engine's keep the model's own."""
    model = build("llama4_text")
    shape = prepare_model(model, model.config.num_hidden_layers, self_check=False)
    with model_check.chunks_crossed(model):
        crossed = model_check.crossed_shape(model, shape)
    assert {layer.chunk for layer in crossed.attention} == {None, model_check.CHECK_CHUNK}
    assert {layer.chunk for layer in shape.attention} == {None, model.config.attention_chunk_size}
