"""DeepSeek-V3.2: DeepSeek-V3's multi-head latent attention with DeepSeek Sparse Attention (DSA), paged as V3's
latent (deepseek_v3.py), within `index_topk` positions.

transformers' DeepseekV32Attention is V3's MLA (a low-rank query, the compressed latent and the shared roped key
cached per token, `kv_b_proj` expanding them per head) plus an indexer: its own small projections score every
cached key for each query, keep the `index_topk` best (`min(index_topk, keys)`), and mask the rest out of the
attention. While a sequence holds at most `index_topk` tokens every key is among the kept ones (keys the causal
mask hides score -inf and stay masked either way), so the attention is exactly V3's dense MLA: the paged forward
runs deepseek_v3's absorbed latent attention and never calls the indexer, whose key cache (transformers keeps it
beside the latent, `cache.update_indexer`) is not stored. Past `index_topk` tokens the indexer drops keys, which
the paged attention would not, so the engine caps the context at `index_topk`
(`model_check.sparse_attention_limit`; a longer max_model_len is refused with that reason).

Unlike V3 (`config.rope_interleave`), V3.2's attention always rotates interleaved pairs: the rotary here is its
own `apply_rotary_pos_emb_interleave`.
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    apply_rotary_pos_emb_interleave,
)

from paged_backend.model.adapters import deepseek_v3
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.paged_cache import PackedStepCache


def rotate(module: DeepseekV32Attention, q_rope: torch.Tensor, k_rope: torch.Tensor,
           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """V3.2's rotary embedding (interleaved pairs) of `q_rope [T, H, P]` and `k_rope [T, 1, P]`."""
    cos, sin = position_embeddings
    return apply_rotary_pos_emb_interleave(q_rope, k_rope, cos[0], sin[0], unsqueeze_dim=1)


def paged_forward(module: DeepseekV32Attention, cache: PackedStepCache, hidden_states: torch.Tensor, *args,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                  paged_single_row: object = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Dense latent attention (the indexer keeps every key within index_topk positions); see the module doc."""
    return deepseek_v3.latent_forward(module, cache, hidden_states, position_embeddings, rotate)


ADAPTER = register_adapter(Adapter("deepseek_v32", (DeepseekV32Attention,), paged_forward, "cache",
                                   deepseek_v3.prepare))
