"""Mamba-2 mixers of hybrid models (Granite 4.0 hybrid, Falcon-H1), run from state slots.

Per sequence and layer a Mamba-2 mixer keeps the last `mamba_d_conv` inputs of its causal convolution and an
SSM state `[heads, head_dim, d_state]` (fp32, as transformers keeps it). transformers 5.25 factors the mixer's
cache use into `causal_conv1d_forward` and `mamba2_scan_forward`, which reach the cache through a handful of
methods; the paged forward runs the mixer's own forward on each sequence of the packed row with a `SlotView`
(recurrent_state.py) as that cache. That is transformers' own torch path: its chunked scan for a prefill
chunk (from the slot's state when the sequence continues), its one-token recurrence for decode tokens. The
step's sequences run in batches of one length and one kind (continuing a state or starting from zeros), their
states gathered from their slots and stored back: every decode token of a step in one mixer call (projections
included), and prompt chunks of one length together. Qwen3-Next's gated delta-net layers reach their cache
through the same methods and run through the same paged forward (qwen3_next.py).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_backend.model.paged.paged_cache import PackedStepCache, ShapeProbe
from paged_backend.core.layer_specs import StateSpec
from paged_backend.model.paged.recurrent_state import SlotView
from paged_backend.model.paged.step_context import current_step


def mamba2_layout(config, layers: list[int], inner: int) -> dict[int, tuple[StateSpec, ...]]:
    """The state of each of `layers`, Mamba-2 mixers with `inner` channels before their output projection."""
    conv_dim = inner + 2 * config.mamba_n_groups * config.mamba_d_state
    conv = StateSpec((conv_dim, config.mamba_d_conv))
    ssm = StateSpec((config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state), torch.float32)
    return {layer: (conv, ssm) for layer in layers}


def paged_forward(module: nn.Module, cache: PackedStepCache, hidden_states: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """`hidden_states [1, T, hidden]` of the packed step -> the mixer's output `[1, T, hidden]`."""
    forward = module._paged_original_forward
    if isinstance(cache, ShapeProbe):  # the start-up probe: one sequence from a zero state
        cache.reached(module.layer_idx, "recurrent")
        return forward(hidden_states, cache=None)
    state, step = current_step().recurrent_state()
    conv, ssm = state.layer(module.layer_idx)
    # Sequences alike in length and in whether they continue a state run as one batch: every decode token
    # of the step together, and prompt chunks of one length (a batch of equal prompts) together.
    groups: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    for lo, hi, slot, continues in step.segments():
        groups.setdefault((hi - lo, continues), []).append((lo, slot))
    out = torch.empty_like(hidden_states)
    for (length, continues), members in groups.items():
        starts = torch.tensor([lo for lo, _ in members], device=hidden_states.device)
        rows = starts[:, None] + torch.arange(length, device=hidden_states.device)  # [B, length]
        slots = [slot for _, slot in members]
        out[0, rows] = run_batch(forward, hidden_states[0, rows], conv, ssm, slots, continues)
    return out


def run_batch(forward, tokens: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, slots: list[int],
              continues: bool) -> torch.Tensor:
    """Several sequences' tokens `[B, length, hidden]` through the mixer as one batch: their states gathered from
    `slots` into one view (unread when they start from zeros), advanced by the mixer, and stored back."""
    index = torch.tensor(slots, device=conv.device)
    view = SlotView(conv[index], ssm[index], continues)  # copies: the mixer updates them in place
    out = forward(tokens, cache=view)
    conv[index] = view.conv
    ssm[index] = view.recurrent
    return out
