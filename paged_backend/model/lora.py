"""Many LoRA adapters on one base model, chosen per request, mixed in one packed step.

An adapter is registered once (`LoRARegistry.add`, from a PEFT folder or a loaded `PeftModel`): its
weights are read, checked against the base model's modules and kept on the host. Up to `max_loras`
adapters sit in device *slots* at a time (`LoRASlots`): per targeted linear layer, the stacked A and
B of the loaded adapters, ranks padded to `max_lora_rank` with zeros, zeros where an adapter does not
target the module; slot 0 is the base model (no delta). The scheduler admits a request only when its
adapter has a slot (loaded already, or a slot no running request uses), so more distinct adapters
than slots means waiting, never failing; and it keeps one busy slot from taking new users while a
request waits for a slot (`slot_to_drain`), so that waiting ends.

Each packed token carries its request's slot. Per step, the runner turns those into a mask of each
token's rank columns (`LoRAStep`), opened as a context around the forward the way the attention ops
get their metadata. A forward hook on every targeted linear adds the whole batch's delta with two
matmuls (see `LoRALinearHook`): no loop over tokens or adapters. Outside a step the hooks add
nothing, so the model object stays the base model.

Eagerly, a linear is hooked when the first adapter targeting it loads. A compiled forward traces the hooks
into its graph and is not told of later ones (it drops the guards on the model's modules), so a compiled
engine hooks every linear an adapter may target before it compiles (`hook_adaptable_linears`; adapters
targeting anything else are refused when read) and gives every step a mask, zeros where no token runs an
adapter, so one graph serves steps with and without adapters.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_backend.model.step_context import LoRAStep, current
from paged_backend.model.quantized_linear import QuantizedLinear


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's name). With `path`, an adapter not registered yet
    is registered under `name` from that PEFT folder on first use."""

    name: str
    path: str | None = None


LoRASpec = str | LoRARequest


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """One registered adapter: per targeted module, `(A [r, in], B [out, r], scaling)` on the host."""

    name: str
    id: int  # unique per registration: a re-registered name never shares cached K/V with its predecessor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.weights.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[-1] for name in self.weights})


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """An adapter as plain data: its PEFT config and its `lora_A`/`lora_B` state dict on the host, in
    PEFT's saved key names. What a loaded `PeftModel` becomes to travel to another process (see
    `portable_source`); `add_lora` reads it like a folder."""

    config: dict
    state: dict[str, torch.Tensor]


# ------------------------------------------------------------------------ reading adapters

_ids = itertools.count(1)
_SUPPORTED_KEYS = (".lora_A.weight", ".lora_B.weight")


def read_adapter(name: str, source: Any, model: nn.Module, max_rank: int,
                 adapter_name: str | None = None) -> LoRAAdapter:
    """Read a LoRA adapter from a PEFT folder, a loaded `PeftModel` (its `adapter_name`, by default
    the active one) or `LoRAWeights`, and check it against `model`; ValueError saying what does not fit."""
    if isinstance(source, (str, os.PathLike)):
        config, state = _read_folder(Path(source))
    else:
        weights = portable_source(source, adapter_name, f"add_lora({name!r}, ...): ")
        config, state = weights.config, weights.state
    check_config(name, config)
    weights = {}
    linears = adaptable_linears(model)
    for module_name, (a, b) in _pair_weights(name, state).items():
        linear = _target_linear(name, model, module_name, linears)
        r = a.shape[0]
        if a.shape != (r, linear.in_features) or b.shape != (linear.out_features, r):
            raise ValueError(f"LoRA adapter {name!r} does not match the base model: {module_name} is "
                             f"{linear.in_features} -> {linear.out_features}, the adapter's A is {tuple(a.shape)} "
                             f"and B {tuple(b.shape)} (an adapter trained on another model?)")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {r} at {module_name}, above max_lora_rank={max_rank}")
        dtype = weight_of(linear).dtype
        weights[module_name] = (a.to(dtype).contiguous(), b.to(dtype).contiguous(), _scaling(config, module_name, r))
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} has no LoRA weights")
    return LoRAAdapter(name, next(_ids), weights)


def portable_source(source: Any, adapter_name: str | None = None, context: str = "") -> str | LoRAWeights:
    """`source` in a form another process can read: a folder as its absolute path (that process reads
    the files itself, so the path must exist there too), a `PeftModel` as the `LoRAWeights` of
    `adapter_name` (by default its active adapter). Nothing is checked against a base model here;
    `context` prefixes the TypeError for anything else."""
    if isinstance(source, (str, os.PathLike)):
        return os.path.abspath(os.fspath(source))
    if isinstance(source, LoRAWeights):
        return source
    if callable(getattr(source, "get_base_model", None)) and hasattr(source, "peft_config"):
        return LoRAWeights(*_read_peft_model(source, adapter_name))
    raise TypeError(f"{context}expected a PEFT adapter folder or a PeftModel, got {type(source).__name__}")


def read_lora_layers(name: str, model: nn.Module, adapter_name: str, max_rank: int) -> LoRAAdapter:
    """Adapter `adapter_name` read from the PEFT LoRA layers inside `model` (a PeftModel's own model)."""
    weights = {}
    for module_name, module in model.named_modules():
        if adapter_name in (getattr(module, "lora_embedding_A", None) or {}):
            raise ValueError(f"LoRA adapter {adapter_name!r} adapts an embedding ({module_name}): "
                             "embedding LoRA is not supported")
        if adapter_name not in (getattr(module, "lora_A", None) or {}):
            continue
        if adapter_name in (getattr(module, "lora_variant", None) or {}):
            raise ValueError(f"LoRA adapter {adapter_name!r} at {module_name} is a LoRA variant (e.g. DoRA): "
                             "not supported")
        linear = base_linear(module)
        if not is_linear(linear):
            raise ValueError(f"LoRA adapter {adapter_name!r} targets {module_name}, a {type(linear).__name__}: "
                             f"{ONLY_LINEAR}")
        if linear is output_embedding(model):
            raise ValueError(f"LoRA adapter {adapter_name!r} targets the output embedding ({module_name}): "
                             "not supported")
        a, b = module.lora_A[adapter_name].weight.detach(), module.lora_B[adapter_name].weight.detach()
        if a.shape[0] > max_rank:
            raise ValueError(f"LoRA adapter {adapter_name!r} has rank {a.shape[0]} at {module_name}, above "
                             f"max_lora_rank={max_rank}")
        dtype = weight_of(linear).dtype
        weights[module_name] = (a.to(dtype).clone(), b.to(dtype).clone(),
                                float(module.scaling[adapter_name]))
    if not weights:
        raise ValueError(f"the model has no LoRA layers for adapter {adapter_name!r}")
    return LoRAAdapter(name, next(_ids), weights)


def _read_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
    config = json.loads(config_file.read_text())
    from peft.utils import load_peft_weights

    return config, load_peft_weights(str(path), device="cpu")


def _read_peft_model(model: Any, adapter_name: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    from peft.utils import get_peft_model_state_dict

    adapter_name = adapter_name or model.active_adapter
    if adapter_name not in model.peft_config:
        raise ValueError(f"the PeftModel has no adapter {adapter_name!r}; it has {sorted(model.peft_config)}")
    config = model.peft_config[adapter_name].to_dict()
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return config, {k: v.detach().cpu() for k, v in state.items()}


def check_config(name: str, config: dict) -> None:
    """Refuse the PEFT variants whose delta is not `B @ A * scaling` on a linear layer."""
    peft_type = str(config.get("peft_type", ""))
    if peft_type.split(".")[-1].upper() != "LORA":
        raise ValueError(f"adapter {name!r} is a {peft_type or 'non-PEFT'} adapter: only LoRA adapters are served")
    refusals = {
        "use_dora": "DoRA adapters (use_dora=True) are not supported",
        "lora_bias": "LoRA with a bias on B (lora_bias=True) is not supported",
        "modules_to_save": "adapters that replace whole modules (modules_to_save) are not supported",
        "trainable_token_indices": "adapters with trainable tokens are not supported",
        "target_parameters": "LoRA on parameters (target_parameters) is not supported",
        "layer_replication": "adapters with layer_replication are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) LoRA is not supported",
    }
    for key, message in refusals.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {message}")


def _pair_weights(name: str, state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's saved keys `base_model.model.<module>.lora_A.weight` -> {module: (A, B)}."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if "lora_embedding" in key:
            raise ValueError(f"LoRA adapter {name!r} adapts an embedding ({key}): embedding LoRA is not supported")
        suffix = next((s for s in _SUPPORTED_KEYS if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"LoRA adapter {name!r}: unsupported weight {key!r} (only lora_A/lora_B of linear layers)")
        module = key[: -len(suffix)].removeprefix("base_model.model.")
        halves.setdefault(module, {})[suffix[6]] = tensor
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{next(iter(ab))} without its other half")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _target_linear(name: str, model: nn.Module, module_name: str, linears: dict[str, nn.Module]) -> nn.Module:
    """The linear `module_name` of `model` when an adapter may target it (`linears`, adaptable_linears), else
    ValueError saying why not."""
    if module_name in linears:
        return linears[module_name]
    try:
        module = base_linear(model.get_submodule(module_name))
    except AttributeError:
        raise ValueError(f"LoRA adapter {name!r} does not match the base model ({type(model).__name__}): it targets "
                         f"{module_name}, which this model does not have") from None
    if module is output_embedding(model):
        raise ValueError(f"LoRA adapter {name!r} targets the output embedding ({module_name}): not supported")
    if getattr(module, "_paged_absorbed", False):
        raise ValueError(f"LoRA adapter {name!r} targets {module_name}, whose weight the paged latent attention "
                         "folds into its query and output instead of calling the layer: not supported")
    if is_linear(module):
        raise ValueError(f"LoRA adapter {name!r} targets {module_name}, a part of a PEFT tuner layer: target the "
                         "tuner layer itself")
    raise ValueError(f"LoRA adapter {name!r} targets {module_name}, a {type(module).__name__}: {ONLY_LINEAR}")


def base_linear(module: nn.Module) -> nn.Module:
    """The layer itself, or the base layer a PEFT tuner layer wraps (a base model that is itself a PeftModel)."""
    get_base_layer = getattr(module, "get_base_layer", None)
    return get_base_layer() if callable(get_base_layer) else module


# PEFT's own modules inside a tuner layer: never an adapter's target (the tuner layer is, by its base layer).
_PEFT_PARTS = {"base_layer", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout",
               "lora_magnitude_vector"}


def adaptable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The linears an adapter may target, by module name as adapters name them: every linear layer of
    `model` (a PEFT tuner layer by its base layer) but the output embedding, which sees only the step's
    kept rows, not every token the mask covers, and a projection whose weight a latent-attention adapter folds
    into its query and output (adapters/deepseek_v3.py), whose forward never runs."""
    head = output_embedding(model)
    linears = {}
    for name, module in model.named_modules():
        if _PEFT_PARTS.intersection(name.split(".")):
            continue
        linear = base_linear(module)
        if is_linear(linear) and linear is not head and not getattr(linear, "_paged_absorbed", False):
            linears[name] = linear
    return linears


ONLY_LINEAR = "only linear layers (nn.Linear, or this engine's int4 layers) are supported"


def is_linear(module: nn.Module) -> bool:
    """An `nn.Linear`, or a `QuantizedLinear` (int4 weights): the hook adds the delta to either's output,
    so adapters serve over a quantized base as over its float weights."""
    return type(module) is nn.Linear or isinstance(module, QuantizedLinear)


def weight_of(linear: nn.Module) -> torch.Tensor:
    """The float weight a linear multiplies by in the model's dtype (a quantized layer's dense copy): what an
    adapter's A and B are stored like."""
    return linear.dense if isinstance(linear, QuantizedLinear) else linear.weight


def output_embedding(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return None if head is None else base_linear(head)


def _scaling(config: dict, module_name: str, r: int) -> float:
    """PEFT's scaling: lora_alpha (or its alpha_pattern entry) over r, or over sqrt(r) with rslora."""
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    if patterns:
        from peft.utils.other import get_pattern_key

        alpha = patterns.get(get_pattern_key(patterns.keys(), module_name), alpha)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


class LoRARegistry:
    """The adapters an engine knows by name (any number, on the host). Safe to call from any thread:
    it only reads the base model's shapes; device slots are the engine thread's business."""

    def __init__(self, model: nn.Module, max_rank: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.lock = threading.Lock()

    def add(self, name: str, source: Any, adapter_name: str | None = None) -> LoRAAdapter:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        adapter = read_adapter(name, source, self.model, self.max_rank, adapter_name)
        with self.lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already registered; remove_lora it first")
            self.adapters[name] = adapter
        return adapter

    def replace(self, adapter: LoRAAdapter) -> None:
        """Register `adapter` under its name, in place of any adapter of that name."""
        with self.lock:
            self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget `name`; requests already holding it finish with it."""
        with self.lock:
            if self.adapters.pop(name, None) is None:
                raise ValueError(f"no LoRA adapter named {name!r}; known: {sorted(self.adapters)}")

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def resolve(self, spec: LoRASpec | None) -> LoRAAdapter | None:
        """The adapter a request asked for (None: the base model); ValueError naming the known ones."""
        if spec is None or isinstance(spec, LoRAAdapter):  # already resolved (AsyncEngine does it early)
            return spec
        if isinstance(spec, LoRARequest):
            if spec.path is not None and spec.name not in self.adapters:
                with contextlib.suppress(ValueError):  # registered meanwhile by another caller: use that one
                    return self.add(spec.name, spec.path)
            spec = spec.name
        if not isinstance(spec, str):
            raise ValueError(f"lora must be an adapter name or a LoRARequest, got {type(spec).__name__}")
        adapter = self.adapters.get(spec)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {spec!r}; known adapters: {self.names() or 'none'}")
        return adapter


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
