"""Qwen3-Next: gated full-attention layers (through transformers' interface, paged as any; their output gate is
part of the module's own forward) and gated delta-net layers (`layer_types` "linear_attention"), run from state
slots, with a mixture of experts after each.

Per sequence and layer a gated delta-net keeps what transformers' cache keeps for it: the last
`linear_conv_kernel_dim` inputs of its causal depthwise convolution over q, k and v (`[2 * key_dim + value_dim,
kernel]`, the model's dtype) and its delta-rule state `[linear_num_value_heads, linear_key_head_dim,
linear_value_head_dim]` (fp32, as the delta-rule functions return it). The layer's forward reaches its cache
through the same methods as a Mamba-2 mixer's (`causal_conv1d_forward`, then `get_recurrent_state` /
`update_recurrent_state`), so it runs through mamba2.py's paged forward: its own forward on each batch of the
step's sequences with a `SlotView` on their slots. A prompt chunk runs transformers' chunked gated delta rule
from the slot's state (zeros when the sequence starts), the step's decode tokens its one-token recurrence, as
one batch; the state after each sequence's last token is stored back.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from paged_backend.model.adapters import mamba2
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.paged_cache import PackedStepCache
from paged_backend.core.layer_specs import StateSpec
from paged_backend.model.paged.recurrent_state import register_state_layout


def gated_delta_net_layout(config) -> dict[int, tuple[StateSpec, ...]]:
    """The convolution window and the fp32 delta-rule state of each linear-attention layer."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = StateSpec((2 * key_dim + value_dim, config.linear_conv_kernel_dim))
    recurrent = StateSpec((config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
                          torch.float32)
    return {layer: (conv, recurrent) for layer, kind in enumerate(config.layer_types) if kind == "linear_attention"}


def paged_forward(module: torch.nn.Module, cache: PackedStepCache, hidden_states: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """`hidden_states [1, T, hidden]` of the packed step -> the gated delta-net's output `[1, T, hidden]`: the layer's
    own forward per batch of the step's sequences on their slots (mamba2.paged_forward)."""
    return mamba2.paged_forward(module, cache, hidden_states, attention_mask, **kwargs)


register_state_layout("qwen3_next", gated_delta_net_layout)
ADAPTER = register_adapter(Adapter("qwen3_next", (Qwen3NextGatedDeltaNet,), paged_forward, "cache",
                                   uses_interface=True))
