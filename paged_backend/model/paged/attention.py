"""The attention function registered with transformers' AttentionInterface under the name "paged_backend".

An unmodified HF model calls it with `query [1, H, T, D]`, `key/value [1, KVH, T, D]` and every extra
keyword given to `model.forward`; the engine passes its step as `paged_cache=`, and a compiled
one-token step also as `paged_single_row=`, whose attention is then traced into the graph. Called without one
(the user runs the model directly), it behaves as transformers' SDPA with its own masks, or as its
eager attention when the model soft-caps logits or has attention sinks (SDPA has neither), so a model
switched to it still works outside the engine.

Beyond plain causal attention it honours what a layer asks for: a sliding window and a soft-cap (given
as keywords; a window that transformers puts only in the mask, as Qwen2-MoE does, is read from the config),
attention sinks (gpt-oss passes its per-head sink logits as `s_aux`), and chunked attention (Llama 4: a layer
whose `config.layer_types` entry is "chunked_attention" sees keys only from the start of its query's chunk of
`config.attention_chunk_size` positions; transformers puts that in the mask alone, which the paged path does
not read, so the chunk is found from the layer's config here).

Those options never change from one call to the next, so they are read once: called with the engine's start-up
probe, it notes that the step reached this layer, records what the layer's attention computes (its
LayerAttention, kernels/layer_attention.py) and attends over the probe's own token. Inside an engine step the
kernels read that record, found by the layer's index (step_context.py), and the keywords go unread.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from paged_backend.kernels.layer_attention import LayerAttention
from paged_backend.kernels.torch_attention import attend_one
from paged_backend.kernels.torch_single_row import (
    SingleRowStep,
    write_and_attend_single_row,
)
from paged_backend.model.paged import custom_ops, step_context
from paged_backend.model.compiled.layer_regions import traced_layer
from paged_backend.model.paged.paged_cache import PagedCache, ShapeProbe

ATTENTION_NAME = "paged_backend"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_cache: PagedCache | ShapeProbe | None = None,
    paged_single_row: SingleRowStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The layer's attention. What the model passes besides the tensors (`sliding_window=`, `softcap=`, `s_aux=`,
    in `kwargs`) describes the layer, not the step: the start-up probe records it (layer_attention), and inside an
    engine step the kernels read that record instead."""
    if paged_cache is None:  # outside the engine: the model's own masks (windows and chunks included) apply
        return attention_outside_engine(module, query, key, value, attention_mask, scaling, dropout, kwargs), None
    if isinstance(paged_cache, ShapeProbe):
        layer = layer_attention(module, query.shape[-1], scaling, kwargs)
        paged_cache.reached(module.layer_idx, "adapter" if hasattr(module, "_paged_original_forward") else "interface",
                            layer)
        out = attend_one(query[0], key[0], value[0], layer)
        return out.transpose(0, 1).unsqueeze(0), None
    if paged_single_row is not None:  # a compiled one-token step (torch_single_row.py)
        layer = step_context.current_step().layer_attention(module.layer_idx)
        out = write_and_attend_single_row(query[0, :, 0], key[0, :, 0], value[0, :, 0], paged_single_row,
                                          traced_layer(module), layer)
        return out[None, None], None
    out = custom_ops.paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                     traced_layer(module))
    return out.unsqueeze(0), None


def layer_attention(module: torch.nn.Module, head_dim: int, scaling: float | None, options: dict) -> LayerAttention:
    """What a layer's attention computes, from what the model passes its attention function (`scaling`, and in
    `options` its `sliding_window`, `softcap` and sinks as `s_aux`) and from its config where transformers keeps
    a window or a chunk in the mask alone (mask_window, attention_chunk_size)."""
    window = options.get("sliding_window")
    return LayerAttention(
        scale=scaling if scaling is not None else head_dim ** -0.5,
        window=window if window is not None else mask_window(module),
        softcap=options.get("softcap"),
        chunk=attention_chunk_size(module),
        sinks=options.get("s_aux"),
    )


def attention_outside_engine(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None, dropout: float,
                             options: dict) -> torch.Tensor:
    """transformers' SDPA with the model's own masks, or its eager attention for a layer that soft-caps logits or
    has attention sinks (SDPA has neither); `[B, T, H, D]`."""
    if options.get("softcap") is None and options.get("s_aux") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **options)[0]
    layer = LayerAttention(scaling if scaling is not None else query.shape[-1] ** -0.5,
                           softcap=options.get("softcap"), sinks=options.get("s_aux"))
    return eager_attention(module, query, key, value, attention_mask, layer, dropout)


def mask_window(module: torch.nn.Module) -> int | None:
    """The sliding window of a layer whose attention call carries none: transformers' Qwen2-MoE attention passes
    no `sliding_window=` and its window lives only in the mask, which the paged path never reads. That mask is
    transformers' sliding-window mask of `config.sliding_window` positions for every "sliding_attention" entry of
    `config.layer_types`, so the window is read from there; None for a full-attention layer."""
    if layer_type(module) != "sliding_attention":
        return None
    return getattr(module.config, "sliding_window", None) or None


def attention_chunk_size(module: torch.nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (Llama 4: "chunked_attention" in `config.layer_types`), whose
    queries see keys only from the start of their own chunk of this many positions; None for other layers."""
    if layer_type(module) != "chunked_attention":
        return None
    return module.config.attention_chunk_size


def layer_type(module: torch.nn.Module) -> str | None:
    """The entry of an attention module's layer in its `config.layer_types` (what transformers builds that layer's
    mask from), or None when the config has none."""
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    return layer_types[layer] if layer_types and layer is not None else None


def eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer: LayerAttention,
    dropout: float,
) -> torch.Tensor:
    """transformers' eager attention at `layer.scale` with tanh soft-capping (Gemma 2's form) and/or attention sinks
    (gpt-oss's: a logit per head `sinks [H]` joins each row's softmax, its weight dropped), for `[B, H, T, D]` inputs
    and a bool or additive mask (None: causal over the keys' last T positions); `[B, T, H, D]`."""
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    scores = torch.matmul(query, key.transpose(2, 3)) * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if attention_mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        attention_mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : key.shape[2]], torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask[..., : key.shape[2]]
    if layer.sinks is not None:
        sink = layer.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        weights = weights.to(query.dtype)
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def paged_mask(*args, **kwargs) -> torch.Tensor | None:
    """The mask transformers builds for this attention: none inside an engine step, whose attention masks by
    position itself (causal, window, chunk) and never reads one; transformers' SDPA mask outside the engine.
    transformers builds a mask for a window layer only when the step is at least a window long (shorter
    causal steps get None), so in a compiled forward that length would be a shape condition of its own: a
    step of a window's length or more fit no warmed-up graph and ran eagerly."""
    if step_context.in_step():
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make `attn_implementation="paged_backend"` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
