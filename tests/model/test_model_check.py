"""The load-time self-check sees what short sequences at the first positions would hide: a sliding window of a
real model's size (thousands of tokens) that the paged path misses, and positions past max_position_embeddings
where a configured context goes there (dynamic rope, learned positions)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.models import CONFIGS, build, build_from_config

from paged_backend import Engine, EngineConfig
from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.model.loading import model_check
from paged_backend.model.paged import attention, custom_ops


def with_window(name: str, window: int):
    """CONFIGS[name] with its sliding window set to `window` positions."""
    base = CONFIGS[name]
    return lambda: type(base()).from_dict({**base().to_dict(), "sliding_window": window})


def drop_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the paged attention attend over the whole context, as a path that missed every window would."""
    kernel = custom_ops.write_and_attend
    monkeypatch.setattr(attention, "mask_window", lambda module: None)
    monkeypatch.setattr(custom_ops, "write_and_attend", lambda *args: kernel(
        *args[:-1], dataclasses.replace(args[-1], window=None)))


# Qwen2-MoE keeps its window only in the mask (attention.mask_window); Gemma 2 passes it to the attention call.
@pytest.mark.parametrize("name", ["qwen2_moe_window", "gemma2"])
@pytest.mark.parametrize("window", [8, 4096])
def test_self_check_refuses_a_paged_path_that_misses_the_window(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                 window: int) -> None:
    """The model passes the check; with the window dropped from the paged path it is refused, with a real
    model's 4096-token window too: the check shrinks the window (model_check.CHECK_WINDOW) so its 7-token
    sequences outgrow it, and gives the window back to the config and the attention modules afterwards."""
    make_config = with_window(name, window)
    Engine(build_from_config(make_config), None, EngineConfig(num_kv_blocks=8))
    model = build_from_config(make_config)
    drop_windows(monkeypatch)
    with pytest.raises(UnsupportedArchitectureError, match="logits differ from the model's own forward"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert model.config.sliding_window == window
    assert {m.sliding_window for m in model.modules() if getattr(m, "sliding_window", None)} <= {window}


def test_the_window_of_a_mask_only_layer_is_read_from_the_config() -> None:
    """Qwen2-MoE's first layer slides (its attention call carries no window); the second attends fully."""
    model = build("qwen2_moe_window")
    layers = model.model.layers
    assert [attention.mask_window(layer.self_attn) for layer in layers] == [8, None]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=16))
    assert engine.cache.groups.frees_blocks  # the window layer frees its old blocks, as Gemma 2's do


def test_dynamic_rope_caps_the_context_at_max_position_embeddings() -> None:
    model = build("llama_dynamic_rope")
    assert Engine(model, None, EngineConfig(num_kv_blocks=256)).max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len=1024: dynamic NTK rope .* max_position_embeddings=512"):
        Engine(model, None, EngineConfig(num_kv_blocks=256, max_model_len=1024))


def test_far_positions_probe_refuses_a_context_where_the_rope_depends_on_the_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the dynamic-rope cap, the probe at positions past max_position_embeddings is what refuses the
    context: the chunked prefill's steps reach different largest positions, so their frequencies differ."""
    monkeypatch.setattr(model_check, "dynamic_rope_limit", lambda text_config: None)
    with pytest.raises(ValueError, match=r"max_model_len=1024 goes past .*=512, where the paged engine's logits "
                                         r"differ"):
        Engine(build("llama_dynamic_rope"), None, EngineConfig(num_kv_blocks=256, max_model_len=1024))


def test_far_positions_probe_refuses_learned_positions_that_end() -> None:
    """GPT-2 has 512 learned positions: a 1024-token context is refused at start, not at the 513th token."""
    with pytest.raises(ValueError, match=r"max_model_len=1024 goes past .*=512, where the model's own forward "
                                         r"fails \(IndexError"):
        Engine(build("gpt2"), None, EngineConfig(num_kv_blocks=256, max_model_len=1024))


def test_far_positions_probe_accepts_a_rotary_model_and_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain rotary model's logits depend on relative positions only: a context past max_position_embeddings
    passes the probe (once per model and context) and the engine runs to it."""
    calls = []
    difference = model_check.logits_difference
    monkeypatch.setattr(model_check, "logits_difference", lambda *a: calls.append(a[2]) or difference(*a))
    model = build("llama")
    assert Engine(model, None, EngineConfig(num_kv_blocks=256, max_model_len=1024)).max_model_len == 1024
    Engine(model, None, EngineConfig(num_kv_blocks=256, max_model_len=1024))
    assert calls == [model_check.near_positions(), model_check.far_positions(1024)]


def test_far_positions_reach_the_end_of_the_context_in_the_second_step() -> None:
    a, b = model_check.far_positions(1024)
    first = model_check.CHECK_STEPS[0][0][1]
    assert a[:first] == list(range(first)) and a[-1] == b[-1] == 1023
    assert [len(a), len(b)] == list(model_check.CHECK_LENGTHS)
    assert torch.tensor(a[first:]).diff().eq(1).all() and torch.tensor(b).diff().eq(1).all()


def test_a_bidirectional_gemma_is_refused_with_the_reason() -> None:
    """EmbeddingGemma's form (use_bidirectional_attention) attends both ways: the self-check refuses it and
    names the setting."""
    base = CONFIGS["gemma"]
    config = lambda: type(base()).from_dict({**base().to_dict(), "use_bidirectional_attention": True})  # noqa: E731
    with pytest.raises(UnsupportedArchitectureError, match="logits differ .* sets use_bidirectional_attention"):
        Engine(build_from_config(config), None, EngineConfig(num_kv_blocks=8))


def test_a_minimax_m3_with_sparse_layers_is_refused_with_the_reason() -> None:
    """MiniMax M3's sparse layers select key blocks through an indexer with a key cache of its own: such a config
    is refused up front (its forward used to fail inside the engine's probe with an IndexError)."""
    base = CONFIGS["minimax_m3_vl_text"]

    def config():
        values = {**base().to_dict(), "layer_types": ["minimax_m3_sparse", "full_attention"], "index_block_size": 4,
                  "index_topk_blocks": 2, "index_local_blocks": 1}
        return type(base()).from_dict(values)

    model = build_from_config(config)
    with pytest.raises(UnsupportedArchitectureError, match="'minimax_m3_sparse'.*lightning indexer"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert model.config._attn_implementation != "paged_backend"


def test_a_forward_that_fails_on_the_probe_is_refused_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a layer's code raises on the engine's one-token probe becomes a refusal that names it."""
    from paged_backend.model.loading import model_loader

    monkeypatch.setattr(model_loader, "UNSUPPORTED_LAYER_TYPES", {})
    base = CONFIGS["minimax_m3_vl_text"]
    config = lambda: type(base()).from_dict({**base().to_dict(), "layer_types": ["minimax_m3_sparse",  # noqa: E731
                                                                                 "full_attention"]})
    with pytest.raises(UnsupportedArchitectureError, match=r"failed on the engine's one-token probe \(IndexError"):
        Engine(build_from_config(config), None, EngineConfig(num_kv_blocks=8))
