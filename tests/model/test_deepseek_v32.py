"""DeepSeek-V3.2 through the paged cache (adapters/deepseek_v32.py): V3's latent attention, its sparse-attention
indexer skipped, the context capped at index_topk (model_check.sparse_attention_limit), within which the indexer
keeps every key. The mixed-batch equivalence with HF generate runs in tests/test_engine_equivalence.py."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import greedy, mixed_prompts
from helpers.models import CONFIGS, build, build_from_config

from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

from paged_backend import Engine, EngineConfig, UnsupportedArchitectureError
from paged_backend.model.adapters import deepseek_v32

# The tiny config's latent (kv_lora_rank 32 + qk_rope_head_dim 16 per token and layer) and index_topk.
LATENT, TOPK = 48, 64


@pytest.fixture(scope="module")
def model():
    return build("deepseek_v32")


def test_context_is_capped_at_index_topk(model):
    """Past index_topk tokens the indexer drops keys: the engine runs up to index_topk=64 and refuses a longer
    prompt, and a longer max_model_len, with the reason."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64))
    assert engine.max_model_len == TOPK
    with pytest.raises(ValueError, match="index_topk=64"):
        engine.add_request(list(range(1, TOPK + 6)), greedy(4))
    with pytest.raises(ValueError, match="max_model_len=128.*DeepSeek Sparse Attention.*index_topk=64"):
        Engine(model, None, EngineConfig(num_kv_blocks=64, max_model_len=128))


def test_cache_holds_the_latent_only(model):
    """One latent row per token and layer, no indexer keys beside it."""
    engine = Engine(model, None, EngineConfig(num_kv_blocks=16, block_size=4))
    assert engine.cache.kv.shape == (model.config.num_hidden_layers, 1, 1, 16 * 4, LATENT)


def test_the_cap_is_where_the_indexer_starts_dropping_keys():
    """Within index_topk the model's own forward equals its dense attention (the same weights with a larger
    index_topk); past it they differ: the cap is the model's, not a margin."""
    def logits(topk: int, length: int) -> torch.Tensor:
        config = CONFIGS["deepseek_v32"]
        model = build_from_config(lambda: config().__class__(**{**config().to_dict(), "index_topk": topk}))
        ids = torch.tensor([(mixed_prompts(2)[1] * 4)[:length]])
        with torch.no_grad():
            return model(ids).logits

    torch.testing.assert_close(logits(8, 8), logits(64, 8), rtol=0, atol=0)
    assert not torch.allclose(logits(8, 24), logits(64, 24), atol=1e-3)


def test_self_check_refuses_a_wrong_rotary(monkeypatch):
    """V3.2 rotates interleaved pairs whatever its config says: a paged path rotating halves is caught by the
    load-time self-check, and the model leaves as it came."""
    model = build("deepseek_v32")
    monkeypatch.setattr(deepseek_v32, "rotate", lambda module, q, k, pe: apply_rotary_pos_emb(
        q, k, pe[0][0], pe[1][0], unsqueeze_dim=1))
    with pytest.raises(UnsupportedArchitectureError, match="logits differ"):
        Engine(model, None, EngineConfig(num_kv_blocks=16))
    attention = model.model.layers[0].self_attn
    assert "forward" not in vars(attention) and "_paged_absorbed" not in vars(attention.kv_b_proj)
