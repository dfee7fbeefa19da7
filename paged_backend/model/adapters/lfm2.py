"""LFM2: attention layers (through transformers' interface, paged as any) and short-convolution layers,
whose state per sequence is the last `conv_L_cache - 1` inputs of their depthwise causal convolution.

The convolution layer's paged forward runs the layer's own projections over the packed row, then the
convolution: a prompt chunk after its slot's saved inputs (zeros for a sequence with nothing computed), the
step's decode tokens as one batch of windows, and the last `L - 1` inputs of each saved back. That is transformers' torch path
(`causal_conv1d_fn` with the cache's inputs in front), so chunked prefill and decode give its numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.paged_cache import PackedStepCache, ShapeProbe
from paged_backend.core.layer_specs import StateSpec
from paged_backend.model.paged.recurrent_state import register_state_layout
from paged_backend.model.paged.step_context import current_step


def state_layout(config) -> dict[int, tuple[StateSpec, ...]]:
    """Each convolution layer keeps `[hidden, L - 1]`: the inputs its next token's window reaches back to."""
    return {layer: (StateSpec((config.hidden_size, config.conv_L_cache - 1)),)
            for layer, kind in enumerate(config.layer_types) if kind == "conv"}


def convolve(module: Lfm2ShortConv, inputs: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution of `inputs [H, T]` after `previous [H, L - 1]`: `[H, T]`."""
    window = torch.cat([previous, inputs], dim=-1).to(module.conv.weight.dtype)
    out = F.conv1d(window[None], module.conv.weight, module.conv.bias, groups=window.shape[0])[0]
    return out.to(inputs.dtype)


def convolve_step(module: Lfm2ShortConv, inputs: torch.Tensor) -> torch.Tensor:
    """Each sequence of the step from its slot's saved inputs, whose last L - 1 are saved back: a prompt chunk
    on its own, the step's decode tokens (one per sequence) as one batch."""
    state, step = current_step().recurrent_state()
    (saved,) = state.layer(module.layer_idx)
    keep = saved.shape[-1]
    out = torch.empty_like(inputs)
    rows, slots = [], []
    for lo, hi, slot, continues in step.segments():
        if hi - lo == 1 and continues:
            rows.append(lo)
            slots.append(slot)
            continue
        previous = saved[slot] if continues else inputs.new_zeros(inputs.shape[0], keep)
        out[:, lo:hi] = convolve(module, inputs[:, lo:hi], previous)
        saved[slot] = torch.cat([previous, inputs[:, lo:hi]], dim=-1)[:, -keep:]
    if rows:
        index = torch.tensor(slots, device=saved.device)
        windows = torch.cat([saved[index], inputs[:, rows].transpose(0, 1)[..., None]], dim=-1)  # [B, H, L]
        weight = module.conv.weight
        conv = F.conv1d(windows.to(weight.dtype), weight, module.conv.bias, groups=windows.shape[1])
        out[:, rows] = conv[..., -1].transpose(0, 1).to(inputs.dtype)
        saved[index] = windows[..., 1:]
    return out


def paged_forward(module: Lfm2ShortConv, cache: PackedStepCache, hidden_states: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """`hidden_states [1, T, hidden]` of the packed step -> the layer's output `[1, T, hidden]`."""
    b, c, x = module.in_proj(hidden_states[0]).transpose(0, 1).chunk(3, dim=0)
    gated = b * x
    if isinstance(cache, ShapeProbe):  # the start-up probe: one sequence from a zero state
        cache.reached(module.layer_idx, "recurrent")
        conv = convolve(module, gated, gated.new_zeros(gated.shape[0], module.conv_kernel_size - 1))
    else:
        conv = convolve_step(module, gated)
    return module.out_proj((c * conv).transpose(0, 1))[None]


register_state_layout("lfm2", state_layout)
ADAPTER = register_adapter(Adapter("lfm2", (Lfm2ShortConv,), paged_forward, "cache", uses_interface=True))
