"""Qwen3.5 (dense and MoE): Qwen3-Next's layer mix (qwen3_next.py) with separate q/k/v, z, b and a input
projections in its gated delta-net layers. Their cache use is Qwen3-Next's (`causal_conv1d_forward`, then the
chunked or recurrent gated delta rule from `get_recurrent_state`), so they run from state slots through the same
paged forward and layout.

A Qwen3.5 checkpoint's config is the multimodal one (`qwen3_5`, `qwen3_5_moe`); transformers'
AutoModelForCausalLM builds its text model from it (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, whose config is
`qwen3_5_text` / `qwen3_5_moe_text`), and the engine runs that on token ids. Its rotary embedding is multimodal
(interleaved sections for time, height and width); text positions are the same in all three, which is plain
rotary, so the engine's one row of positions gives transformers' numbers.
"""

from __future__ import annotations

from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

from paged_backend.model.adapters.qwen3_next import gated_delta_net_layout, paged_forward
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.recurrent_state import register_state_layout

# The checkpoint's multimodal type (which a folder's config.json names) and the text type its causal LM carries.
for model_type, mixer in (("qwen3_5", Qwen3_5GatedDeltaNet), ("qwen3_5_text", Qwen3_5GatedDeltaNet),
                          ("qwen3_5_moe", Qwen3_5MoeGatedDeltaNet), ("qwen3_5_moe_text", Qwen3_5MoeGatedDeltaNet)):
    register_state_layout(model_type, gated_delta_net_layout)
    register_adapter(Adapter(model_type, (mixer,), paged_forward, "cache", uses_interface=True))
