"""The recurrent state of a hybrid model's non-attention layers, one row per state slot, and what a step
tells the mixers about it.

Each hybrid family's adapter (model/adapters/) registers a layout: for each of a model's recurrent layers,
the shapes of its state tensors for one sequence (a short convolution's last inputs; a Mamba-2 mixer's
convolution window and its SSM state). `RecurrentState` allocates each of them with a leading slot
dimension (core/state_slots.py gives each running request a slot). During a step the model runner puts the state and a
`RecurrentStep` in the step context (step_context.py): for every sequence packed in the row, where its tokens start,
how many tokens it had computed before (0: it starts from a zero state) and its slot. A mixer then runs
each sequence's segment from that slot's state and writes the state after its last token back, so a
prefill chunk continues where the previous chunk stopped and a decode token advances the state by one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.core.layer_specs import StateSpec
from paged_backend.core.state_slots import StateSlots

logger = logging.getLogger(__name__)

# config -> {layer index: (each state tensor of one sequence, ...)}
StateLayout = Callable[[PretrainedConfig], dict[int, tuple[StateSpec, ...]]]

STATE_LAYOUTS: dict[str, StateLayout] = {}


def register_state_layout(model_type: str, layout: StateLayout) -> None:
    STATE_LAYOUTS[model_type] = layout


def state_layout(config: PretrainedConfig) -> dict[int, tuple[StateSpec, ...]] | None:
    """The recurrent layers of a model of this config and their state shapes; None for a model without any
    (a hybrid family's config whose layers are all attention, as Granite 4.0 Micro's, included: it runs as
    any attention model, with no state slots)."""
    layout = STATE_LAYOUTS.get(getattr(config, "model_type", None))
    return (layout(config) or None) if layout is not None else None


def is_all_attention_hybrid(config: PretrainedConfig) -> bool:
    """A config of a hybrid family (one with a registered state layout) whose layers are all attention."""
    return getattr(config, "model_type", None) in STATE_LAYOUTS and state_layout(config) is None


class RecurrentState:
    """For each recurrent layer, its state tensors `[num_slots, *shape]` (`zeros`: a slot is read only after
    its sequence wrote it, but a NaN left in memory must not reach a product with zero weight either)."""

    def __init__(self, layout: dict[int, tuple[StateSpec, ...]], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.tensors: dict[int, tuple[torch.Tensor, ...]] = {
            layer: tuple(torch.zeros(num_slots, *spec.shape, dtype=spec.dtype or dtype, device=device)
                         for spec in specs)
            for layer, specs in layout.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for states in self.tensors.values() for t in states)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self.tensors[layer]


@dataclass(frozen=True, slots=True)
class RecurrentStep:
    """The step's sequences as the mixers see them, as host lists (the mixers loop over sequences)."""

    query_start_loc: tuple[int, ...]  # sequence i's tokens are [query_start_loc[i], query_start_loc[i + 1])
    starts: tuple[int, ...]  # tokens sequence i had computed before this step (0: a zero initial state)
    slots: tuple[int, ...]  # sequence i's state slot

    def segments(self) -> Iterator[tuple[int, int, int, bool]]:
        """(first row, end row, slot, whether it continues a state) of each sequence."""
        loc = self.query_start_loc
        for i, slot in enumerate(self.slots):
            yield loc[i], loc[i + 1], slot, self.starts[i] > 0


# Types whose recurrent mixers run their own projections per sequence (adapters/mamba2.py), not over the step's row,
# and what those mixers are (by the text config's type, which hybrid_state reads).
PER_SEQUENCE_PROJECTIONS: dict[str, str] = {
    "granitemoehybrid": "Mamba-2 mixers", "falcon_h1": "Mamba-2 mixers",
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), "gated delta-net layers"),
    "kimi_linear": "Kimi delta attention (KDA) layers",
}


def hybrid_state(model: PreTrainedModel, config, tensor_parallel: bool) -> tuple[RecurrentState | None,
                                                                                 StateSlots | None]:
    """A hybrid model's recurrent state and its slots, one per request that can run (`config.max_num_seqs`);
    (None, None) for a model without recurrent layers. ValueError, naming the field, for what such a model
    cannot run: speculative decoding (a rejected proposal would have advanced the state past the kept
    tokens, and a state cannot be rolled back), tensor parallelism (the state is not sharded) and, for the
    families whose mixers project per sequence (Mamba-2, gated delta-net), LoRA."""
    text_config = model.config.get_text_config()
    layout = state_layout(text_config)
    if layout is None:
        return None, None
    model_type = text_config.model_type
    if config.speculative_config is not None:
        raise ValueError(f"EngineConfig.speculative_config: {model_type} is a hybrid model whose recurrent layers "
                         "cannot take back the state of rejected proposals; run it without speculative decoding")
    if tensor_parallel:
        raise ValueError(f"{model_type} is a hybrid model: its recurrent state is not sharded for tensor parallelism")
    if config.enable_lora and model_type in PER_SEQUENCE_PROJECTIONS:
        raise ValueError(f"EngineConfig.enable_lora: {model_type}'s {PER_SEQUENCE_PROJECTIONS[model_type]} run their "
                         "projections one sequence at a time, which the step's LoRA mask (one row per token of the "
                         "whole step) does not follow; run it without LoRA")
    param = next(model.parameters())
    state = RecurrentState(layout, config.max_num_seqs, param.dtype, param.device)
    logger.info("hybrid model: %d recurrent layers, %d state slots (%.1f MiB); prefix caching off (a cached K/V "
                "prefix has no matching recurrent state); decode steps unpadded (no CUDA graphs)", len(layout),
                config.max_num_seqs, state.nbytes / 2**20)
    return state, StateSlots(config.max_num_seqs)


class SlotView:
    """One sequence's state in one layer, seen through the methods transformers' own mixer code calls on its cache
    (`causal_conv1d_forward`, `mamba2_scan_forward`: conv state 0 and recurrent state 0), so a family whose
    modeling file factors its mixer that way runs its own torch path, one sequence at a time, on a slot.
    `continues`: the sequence has computed tokens before (else it starts from zeros, as a fresh cache does)."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor | None, continues: bool) -> None:
        self.conv = conv  # [1, channels, kernel]: the last `kernel` inputs of the convolution (a view of the slot)
        self.recurrent = recurrent  # [1, ...]: the SSM state (a view of the slot)
        self.continues = continues

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv if self.continues else None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers counts tokens here; positions come from the engine."""

    def update_conv_state(self, inputs: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Keep the last `kernel` inputs; return what the convolution runs over (saved inputs, then the new)."""
        kernel = self.conv.shape[-1]
        if self.continues:
            full = torch.cat([self.conv, inputs.to(self.conv.dtype)], dim=-1)
        else:
            full = torch.nn.functional.pad(inputs, (max(0, kernel - inputs.shape[-1]), 0))
        self.conv.copy_(full[..., -kernel:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent if self.continues else None

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.recurrent.copy_(state)
        return self.recurrent
