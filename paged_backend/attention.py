"""The attention function registered with transformers' AttentionInterface under the name "paged_backend".

An unmodified HF model calls it with `query [1, H, T, D]`, `key/value [1, KVH, T, D]` and every extra
keyword given to `model.forward`; the engine passes its step as `paged_cache=`. Called without one
(the user runs the model directly), it behaves as SDPA with transformers' own masks, so a model
switched to it still works outside the engine.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from paged_backend.kernels import paged_attention

from .paged_cache import PagedCache

ATTENTION_NAME = "paged_backend"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_cache: PagedCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
    key_cache, value_cache = paged_cache.layer(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(
        query[0].transpose(0, 1), key_cache, value_cache, paged_cache.metadata, scale,
        sliding_window=sliding_window, softcap=softcap,
        new_key=key[0].transpose(0, 1), new_value=value[0].transpose(0, 1),
    )
    return out.unsqueeze(0), None


def register() -> None:
    """Make `attn_implementation="paged_backend"` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
