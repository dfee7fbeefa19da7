"""MPT: fused QKV, optional clipping, ALiBi with MPT's own slopes added inside its attention code."""

from __future__ import annotations

import math

import torch
from transformers.models.mpt.modeling_mpt import MptAttention

from paged_backend.model.adapters.registry import (
    Adapter,
    attend,
    register_adapter,
    set_alibi_slopes,
)
from paged_backend.model.paged.paged_cache import PackedStepCache

# transformers' MptModel builds its ALiBi tensor with this default, whatever attn_config says.
HF_ALIBI_BIAS_MAX = 8


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: int = HF_ALIBI_BIAS_MAX) -> torch.Tensor:
    """Slopes of `build_mpt_alibi_tensor`: 2^-(i * max / P) for the next power of two P, interleaved."""
    power = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, power + 1, dtype=torch.int64).float() * (alibi_bias_max / power)
    slopes = 1.0 / torch.pow(2, base)
    if power != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def prepare(module: MptAttention, config) -> None:
    set_alibi_slopes(module, mpt_alibi_slopes(module.n_heads))


def paged_forward(module: MptAttention, cache: PackedStepCache, hidden_states: torch.Tensor,
                  *args, **kwargs) -> tuple[torch.Tensor, None]:
    tokens = hidden_states.shape[1]
    qkv = module.Wqkv(hidden_states[0])
    if module.clip_qkv:
        qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (x.view(tokens, module.n_heads, module.head_dim) for x in qkv.chunk(3, dim=-1))
    out = attend(module, cache, query, key, value, module.softmax_scale, module._paged_alibi_slopes)
    return module.out_proj(out.reshape(1, tokens, -1)), None


ADAPTER = register_adapter(Adapter("mpt", (MptAttention,), paged_forward, "cache", prepare))
