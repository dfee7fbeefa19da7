"""Kimi Linear: Kimi delta attention (KDA) layers, run from state slots, and multi-head latent attention (MLA)
layers without rotary positions, paged as DeepSeek-V3's latent; a mixture of experts after each.

A KDA layer is a gated delta net whose decay is per channel instead of per head. Per sequence and layer it keeps
what transformers' cache keeps for it: the last `linear_conv_kernel_dim` inputs of its causal depthwise
convolution over q, k and v (`[3 * linear_num_heads * linear_head_dim, kernel]`, the model's dtype) and its
delta-rule state `[linear_num_heads, linear_head_dim, linear_head_dim]` (fp32, as the chunked delta rule returns
it). Its forward reaches the cache through the same methods as a Mamba-2 mixer's (`causal_conv1d_forward`, then
`get_recurrent_state` / `update_recurrent_state`), so it runs through mamba2.py's paged forward: its own forward
(chunked delta rule for prompt chunks, one-token recurrence for decode tokens) per batch of the step's sequences,
on their slots.

The MLA layers are DeepSeek-V3's projections (`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`; a full-rank or
low-rank query) with no rotary embedding at all (NoPE: the `qk_rope_head_dim` part of the key is shared by every
head, unrotated): deepseek_v3's absorbed latent attention runs them with the identity as their rotation, the cache
holding one latent row per token (`kv_lora_rank + qk_rope_head_dim`) in those layers and nothing in the KDA ones.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention, KimiLinearDeltaAttention

from paged_backend.model.adapters import deepseek_v3, mamba2
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.paged_cache import PackedStepCache
from paged_backend.core.layer_specs import StateSpec
from paged_backend.model.paged.recurrent_state import register_state_layout


def kda_layout(config) -> dict[int, tuple[StateSpec, ...]]:
    """The convolution window and the fp32 delta-rule state of each KDA layer."""
    width = config.linear_num_heads * config.linear_head_dim
    conv = StateSpec((3 * width, config.linear_conv_kernel_dim))
    recurrent = StateSpec((config.linear_num_heads, config.linear_head_dim, config.linear_head_dim), torch.float32)
    return {layer: (conv, recurrent) for layer, kind in enumerate(config.layer_types) if kind == "linear_attention"}


def no_rotation(module: nn.Module, q_rope: torch.Tensor, k_rope: torch.Tensor,
                position_embeddings: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Linear's MLA has no positional encoding: its shared key part stays as projected."""
    return q_rope, k_rope


def prepare(module: nn.Module, config) -> None:
    if isinstance(module, KimiLinearAttention):
        deepseek_v3.prepare(module, config)


def paged_forward(module: nn.Module, cache: PackedStepCache, hidden_states: torch.Tensor, *args,
                  attention_mask: torch.Tensor | None = None, paged_single_row: object = None, **kwargs):
    """A KDA layer: `[1, T, hidden]` -> its output (mamba2.paged_forward on the slots); an MLA layer: (output, None)
    through the latent cache."""
    if isinstance(module, KimiLinearDeltaAttention):
        return mamba2.paged_forward(module, cache, hidden_states, attention_mask)
    return deepseek_v3.latent_forward(module, cache, hidden_states, None, no_rotation)


register_state_layout("kimi_linear", kda_layout)
ADAPTER = register_adapter(Adapter("kimi_linear", (KimiLinearAttention, KimiLinearDeltaAttention), paged_forward,
                                   "cache", prepare))
