"""Falcon, both families: rotary with multi-query (falcon-7b) or grouped KV (falcon-40b,
`new_decoder_architecture`), and ALiBi (falcon-rw). Its attention calls SDPA itself."""

from __future__ import annotations

import math

import torch
from transformers.models.falcon.modeling_falcon import (
    FalconAttention,
    apply_rotary_pos_emb,
    build_alibi_tensor,
)

from paged_backend.model.adapters.registry import (
    Adapter,
    attend,
    register_adapter,
    set_alibi_slopes,
)
from paged_backend.model.paged.paged_cache import PackedStepCache


def prepare(module: FalconAttention, config) -> None:
    if config.alibi:
        # transformers' Falcon rounds its slopes to bf16 and adds `alibi / sqrt(head_dim)` to logits
        # already scaled by 1 / sqrt(head_dim). Its own builder at key position 1 gives the slopes.
        slopes = build_alibi_tensor(torch.ones(1, 2), module.num_heads, torch.float32).view(module.num_heads, 2)[:, 1]
        set_alibi_slopes(module, slopes / math.sqrt(module.head_dim))
    else:
        module._paged_alibi_slopes = None


def split_qkv(module: FalconAttention, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused [T, ...]` -> q `[T, H, D]`, k and v `[T, KVH, D]`, with KV heads left unrepeated."""
    tokens, dim = fused.shape[0], module.head_dim
    if module.new_decoder_architecture:
        # Per KV head: its group of query heads, then its key, then its value.
        qkv = fused.view(tokens, module.num_kv_heads, -1, dim)
        return qkv[:, :, :-2].reshape(tokens, module.num_heads, dim), qkv[:, :, -2], qkv[:, :, -1]
    if module.multi_query:
        qkv = fused.view(tokens, module.num_heads + 2, dim)
        return qkv[:, :-2], qkv[:, -2:-1], qkv[:, -1:]
    qkv = fused.view(tokens, module.num_heads, 3, dim)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def paged_forward(module: FalconAttention, cache: PackedStepCache, hidden_states: torch.Tensor,
                  *args, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    tokens = hidden_states.shape[1]
    query, key, value = split_qkv(module, module.query_key_value(hidden_states[0]))
    slopes = module._paged_alibi_slopes
    if slopes is None:
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos[0], sin[0], unsqueeze_dim=1)
    out = attend(module, cache, query, key, value, module.inv_norm_factor, slopes)
    return module.dense(out.reshape(1, tokens, -1)), None


ADAPTER = register_adapter(Adapter("falcon", (FalconAttention,), paged_forward, "layer_past", prepare))
