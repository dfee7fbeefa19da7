"""BLOOM: fused per-head QKV, ALiBi added inside its own attention code."""

from __future__ import annotations

import torch
from transformers.models.bloom.modeling_bloom import (
    BloomAttention,
    _get_alibi_slopes,
    dropout_add,
)

from paged_backend.model.adapters.registry import (
    Adapter,
    attend,
    register_adapter,
    set_alibi_slopes,
)
from paged_backend.model.paged.paged_cache import PackedStepCache


def prepare(module: BloomAttention, config) -> None:
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise NotImplementedError("BLOOM with slow_but_exact=True (sliced output projection) has no paged adapter")
    set_alibi_slopes(module, _get_alibi_slopes(module.num_heads, torch.device("cpu")))


def paged_forward(module: BloomAttention, cache: PackedStepCache, hidden_states: torch.Tensor,
                  residual: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
    tokens = hidden_states.shape[1]
    # BLOOM's fused layout is [head, (q, k, v), head_dim] per token.
    qkv = module.query_key_value(hidden_states[0]).view(tokens, module.num_heads, 3, module.head_dim)
    query, key, value = qkv.unbind(2)
    out = attend(module, cache, query, key, value, module.inv_norm_factor, module._paged_alibi_slopes)
    out = module.dense(out.reshape(1, tokens, -1))
    return dropout_add(out, residual, module.hidden_dropout, module.training), None


ADAPTER = register_adapter(Adapter("bloom", (BloomAttention,), paged_forward, "layer_past", prepare))
