"""The latent cache of multi-head latent attention (DeepSeek-V3): a layer's latent write and attention as one
custom op, the latent counterpart of `custom_ops.paged_attention`.

A latent-attention layer caches per token one row of kv_lora_rank + qk_rope_head_dim values (the normalised
compressed latent and the rotary key part) in a cache of one plane and one head (its layers' `LatentAttentionSpec`),
not the expanded K/V of every head. Its adapter (adapters/deepseek_v3.py) projects each query head into the
latent space, and this op attends those queries over the latents as one shared key head whose value is the
latent (dispatch.write_and_attend_latent). Like the K/V op, it takes tensors and the layer's index only and reads
the step, the cache and the layer's attention record (its scale) from the step context (step_context.py), so a
compiled graph holds it as one opaque node.
"""

from __future__ import annotations

import torch

from paged_backend.kernels.dispatch import write_and_attend_latent
from paged_backend.model.paged.custom_ops import layer_operand
from paged_backend.model.paged.step_context import current_step


def latent_attention_impl(query: torch.Tensor, latent: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """Write this step's `latent [T, 1, D]` into layer `layer` of the step's latent cache at the step's slot mapping,
    then attend packed `query [T, H, D]` over each sequence's latents (key and value alike); returns `[T, H, D]`.
    `layer` is a 0-d CPU tensor inside a compiled graph (custom_ops.layer_operand), an int eagerly."""
    metadata, cache, attention = current_step().layer_step(int(layer))
    return write_and_attend_latent(query.contiguous(), latent, cache, metadata, attention)


latent_attention_op = torch.library.custom_op("paged_backend::latent_attention", latent_attention_impl,
                                              mutates_args=())


@latent_attention_op.register_fake
def _(query, latent, layer):
    return query.new_empty(query.shape)


def latent_attention(query: torch.Tensor, latent: torch.Tensor, layer: int | torch.Tensor) -> torch.Tensor:
    """The op inside a graph being compiled, its implementation directly in an eager forward (as
    custom_ops.paged_attention, to skip the dispatcher's cost per layer)."""
    if torch.compiler.is_compiling():
        return latent_attention_op(query, latent, layer_operand(layer))
    return latent_attention_impl(query, latent, layer)
