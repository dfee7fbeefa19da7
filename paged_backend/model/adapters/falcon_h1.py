"""Falcon-H1: every layer runs attention (through transformers' interface, paged as any) and a Mamba-2 mixer
side by side on the same input; the mixers run from state slots (mamba2.py)."""

from __future__ import annotations

from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer

from paged_backend.model.adapters.mamba2 import mamba2_layout, paged_forward
from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.core.layer_specs import StateSpec
from paged_backend.model.paged.recurrent_state import register_state_layout


def state_layout(config) -> dict[int, tuple[StateSpec, ...]]:
    inner = config.mamba_d_ssm if config.mamba_d_ssm is not None else int(config.mamba_expand * config.hidden_size)
    return mamba2_layout(config, list(range(config.num_hidden_layers)), inner)


register_state_layout("falcon_h1", state_layout)
ADAPTER = register_adapter(Adapter("falcon_h1", (FalconH1Mixer,), paged_forward, "cache", uses_interface=True))
