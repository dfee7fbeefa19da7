"""Granite 4.0 hybrid (GraniteMoeHybrid): attention layers (through transformers' interface, paged as any)
and Mamba-2 layers (`layer_types` "linear_attention"), run from state slots (mamba2.py)."""

from __future__ import annotations

from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

from paged_backend.model.adapters.mamba2 import mamba2_layout, paged_forward
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.core.layer_specs import StateSpec
from paged_backend.model.paged.recurrent_state import register_state_layout


def state_layout(config) -> dict[int, tuple[StateSpec, ...]]:
    layers = [layer for layer, kind in enumerate(config.layers_block_type) if kind == "linear_attention"]
    return mamba2_layout(config, layers, int(config.mamba_expand * config.hidden_size))


register_state_layout("granitemoehybrid", state_layout)
ADAPTER = register_adapter(Adapter("granitemoehybrid", (GraniteMoeHybridMambaLayer,), paged_forward, "cache",
                                   uses_interface=True))
