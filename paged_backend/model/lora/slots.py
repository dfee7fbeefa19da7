"""The adapters on the device: `LoRASlots` (at most `max_loras`, which running requests use them) and the
forward hook on each targeted linear that adds the whole step's delta (`LoRALinearHook`)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from paged_backend.model.paged.step_context import LoRAStep, current
from paged_backend.model.lora.adapter import LoRAAdapter
from paged_backend.model.lora.reading import adaptable_linears, base_linear, weight_of

class LoRALinearHook:
    """A forward hook on one targeted linear, holding every adapter slot's weights for it, stacked:
    `a [max_loras * max_rank, in]` and `b [max_loras * max_rank, out]` (B transposed, scaling folded in),
    ranks padded with zero rows, zeros for a slot whose adapter does not target this module.

    The delta of the whole packed batch is `((x @ a.T) * mask) @ b`: the first product projects every
    token onto every loaded adapter's rank space (a few dozen columns beside the layer's hundreds),
    the mask keeps each token's own adapter's columns, the second adds that adapter's B. Two matmuls
    per layer whatever the mix of adapters, no loop over adapters or tokens; base tokens get exact
    zeros. The cost grows with max_loras x max_lora_rank, which is why both are bounded."""

    def __init__(self, linear: nn.Module, owner: LoRASlots, max_loras: int, max_rank: int) -> None:
        weight = weight_of(linear)
        self.owner = owner  # two engines on one model each hook its linears: each applies only its own steps
        self.max_rank = max_rank
        self.a = weight.new_zeros(max_loras * max_rank, linear.in_features)
        self.b = weight.new_zeros(max_loras * max_rank, linear.out_features)
        self.handle = linear.register_forward_hook(self)

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        """Put `weights` (None: zeros) in adapter slot `slot` >= 1."""
        rows = slice((slot - 1) * self.max_rank, slot * self.max_rank)
        self.a[rows].zero_()
        self.b[rows].zero_()
        if weights is not None:
            a, b, scale = weights
            r = a.shape[0]
            self.a[rows][:r].copy_(a)
            self.b[rows][:r].copy_(b.T * scale)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        context = current()
        step = context.lora if context is not None else None
        if step is None or step.owner is not self.owner:
            return output
        x = args[0].reshape(-1, self.a.shape[1])
        projected = torch.mm(x, self.a.T).mul_(step.mask)
        output.view(-1, output.shape[-1]).addmm_(projected, self.b)
        return output


class LoRASlots:
    """The adapters loaded on the device (at most `max_loras`) and which running requests use them.
    Engine thread only."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.hooks: dict[str, LoRALinearHook] = {}
        self.hooks_fixed = False  # every adaptable linear hooked up front, for a compiled forward
        self.loaded: list[LoRAAdapter | None] = [None] * (max_loras + 1)  # index 0: the base, never loaded
        self.users = [0] * (max_loras + 1)
        self.last_used = [0] * (max_loras + 1)
        self.clock = itertools.count(1)
        self.dtype = next(model.parameters()).dtype

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        return next((s for s in range(1, self.max_loras + 1) if self.loaded[s] is adapter), None)

    def has_idle_slot(self) -> bool:
        """Whether some slot has no running user, so an adapter not loaded yet can be loaded into it."""
        return any(self.users[s] == 0 for s in range(1, self.max_loras + 1))

    def slot_to_drain(self) -> int:
        """The slot to empty for a request that found every slot busy: the one with the fewest running
        users (the soonest to drain, as far as counts tell), the least recently acquired among equals.
        While the scheduler holds it back its count only falls and its last use stays oldest, so the
        choice stays put from step to step instead of moving between slots that never empty."""
        return min(range(1, self.max_loras + 1), key=lambda s: (self.users[s], self.last_used[s]))

    def acquire(self, adapter: LoRAAdapter | None) -> int:
        """The slot a running request uses (0 for the base), loading the adapter into an idle slot if needed."""
        if adapter is None:
            return 0
        slot = self.slot_of(adapter)
        if slot is None:
            idle = [s for s in range(1, self.max_loras + 1) if self.users[s] == 0]
            if not idle:
                raise RuntimeError("no idle LoRA slot (the scheduler checks has_idle_slot first)")
            slot = min(idle, key=lambda s: (self.loaded[s] is not None, self.last_used[s]))  # empty, then LRU
            self.load(slot, adapter)
        self.users[slot] += 1
        self.last_used[slot] = next(self.clock)
        return slot

    def release(self, slot: int) -> None:
        if slot:
            self.users[slot] -= 1

    def hook_adaptable_linears(self) -> int:
        """Hook every linear an adapter may target (adaptable_linears: read_adapter refuses any other), before
        the forward is compiled, so that loading an adapter never adds a hook; return how many are hooked."""
        for name, linear in adaptable_linears(self.model).items():
            if name not in self.hooks:
                self.hooks[name] = LoRALinearHook(linear, self, self.max_loras, self.max_rank)
        self.hooks_fixed = True
        return len(self.hooks)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for module_name in adapter.weights:
            if module_name not in self.hooks:
                linear = base_linear(self.model.get_submodule(module_name))
                self.hooks[module_name] = LoRALinearHook(linear, self, self.max_loras, self.max_rank)
        with torch.no_grad():
            for module_name, hook in self.hooks.items():
                hook.load(slot, adapter.weights.get(module_name))
        self.loaded[slot] = adapter

    def prepare_step(self, request_slots: np.ndarray, counts: np.ndarray,
                     device: torch.device) -> LoRAStep | None:
        """The step's token-to-adapter mask from each request's slot and token count. When every token runs
        the base: None (the hooks then add nothing), or with hooks fixed for a compiled forward, a mask of
        zeros, so that steps with and without adapters run one graph."""
        if not request_slots.any() and not self.hooks_fixed:
            return None
        token_slots = np.repeat(request_slots, counts)
        columns = np.repeat(np.arange(1, self.max_loras + 1), self.max_rank)
        mask = token_slots[:, None] == columns[None, :]
        return LoRAStep(torch.from_numpy(mask).to(device=device, dtype=self.dtype, non_blocking=True), self)
