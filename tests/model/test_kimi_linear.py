"""Kimi Linear through the engine (adapters/kimi_linear.py): its Kimi delta attention layer runs from state slots,
its latent-attention layer (no rotary positions) caches one latent row per token. The mixed-batch equivalence with
HF generate runs in tests/test_engine_equivalence.py."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import MAX_NEW, greedy, hf_greedy, run_to_completion
from helpers.models import build

from paged_backend import Engine, EngineConfig, UnsupportedArchitectureError
from paged_backend.core.layer_specs import LatentAttentionSpec
from paged_backend.model.paged.recurrent_state import SlotView


def test_kda_chunked_prefill_crosses_the_delta_rule_chunks():
    """Prompts longer than the chunked KDA rule's chunk (64 tokens), prefilled in 48-token engine chunks, so each
    continuation starts inside a delta-rule chunk from its slot's convolution window and fp32 state; three of one
    length run as one batch beside decode tokens of the others: every sequence equals generate. The pages hold the
    latent layer alone (32 + 16 values per token), the slots the KDA layer alone."""
    model = build("kimi_linear")
    chunk = 64  # chunk_kimi_delta_attention's default, which KimiLinearDeltaAttention calls it with
    g = torch.Generator().manual_seed(5)
    lengths = [2 * chunk + 30, chunk + 1, chunk + 17, chunk + 17, chunk + 17, 9]
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=48))
    shape = engine.cache.shape
    assert shape.layers[0].name == "recurrent" and set(shape.layers[1:]) == {LatentAttentionSpec(32)}
    assert shape.head_dim == 48
    assert list(engine.recurrent.tensors) == [0]
    conv, state = engine.recurrent.layer(0)
    assert conv.shape[1:] == (3 * 4 * 16, 4) and state.shape[1:] == (4, 16, 16) and state.dtype == torch.float32
    ids = [engine.add_request(p, greedy(MAX_NEW)) for p in prompts]
    finals = run_to_completion(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_lora_is_refused():
    with pytest.raises(ValueError, match="EngineConfig.enable_lora: kimi_linear's Kimi delta attention"):
        Engine(build("kimi_linear"), None, EngineConfig(num_kv_blocks=16, enable_lora=True))


def test_self_check_refuses_a_kda_layer_that_forgets_its_state(monkeypatch):
    monkeypatch.setattr(SlotView, "get_recurrent_state", lambda self, layer_idx, state_idx=0: None)
    model = build("kimi_linear")
    with pytest.raises(UnsupportedArchitectureError, match="logits differ"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
    assert not any(hasattr(m, "_paged_original_forward") for m in model.modules())
    assert "_paged_absorbed" not in vars(model.model.layers[1].self_attn.kv_b_proj)
