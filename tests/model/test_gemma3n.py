"""Gemma 3n is refused for its KV sharing (model_loader.UNSUPPORTED_REASONS): its last layers read the K/V of
earlier ones, which the paged cache does not map between layers."""

from __future__ import annotations

import pytest
from helpers.models import _auto, build_from_config

from paged_backend import Engine, EngineConfig, UnsupportedArchitectureError


def test_kv_sharing_is_the_reason_gemma3n_is_refused():
    model = build_from_config(lambda: _auto(
        "gemma3n_text", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=2, laurel_rank=8,
        altup_num_inputs=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4, intermediate_size=[128] * 4))
    assert model.config.kv_sharing_modes[2:] == ["reuse", "reuse"]
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedArchitectureError, match=r"model_type='gemma3n_text'.*\(KV sharing\)"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
    assert model.config._attn_implementation == before
