"""`generate(..., cache_implementation="paged", adapter_names=[...])` on a PEFT model: one adapter per row.

PEFT's own mixed-batch inference takes `adapter_names` in `PeftModel.generate` and, for the length of the
call, hooks every LoRA layer so its forward receives the list and splits the batch by row. The engine
packs rows into one `[1, T]` forward, so that split cannot run there. Instead the call's adapters are
registered on the model's engine (read from the LoRA layers themselves), each row becomes an engine
request with its adapter (`"__base__"`: none), and while the engine runs, PEFT's per-row hooks are set
aside and its LoRA layers act as their base layers, the engine adding each row's delta itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

from torch import nn

from paged_backend.config import EngineConfig
from paged_backend.engine import Engine
from paged_backend.model.lora import read_lora_layers

BASE_NAME = "__base__"  # PEFT's name for "no adapter" in adapter_names
HOOK_NAME = "_adapter_names_pre_forward_hook"


def row_adapter_names(model: nn.Module) -> list[str] | None:
    """The `adapter_names` PEFT's generate has hooked into this model's LoRA layers for this call, if any."""
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, functools.partial) and getattr(hook.func, "__name__", "") == HOOK_NAME:
                return list(hook.keywords["adapter_names"])
    return None


def lora_config(model: nn.Module, names: list[str], current: EngineConfig | None) -> EngineConfig:
    """An engine config with LoRA on and room for every adapter of the call (the model's engine's, if any)."""
    ranks = [module.r[name] for module in lora_layers(model) for name in set(names) if name in module.r]
    wanted = {"enable_lora": True, "max_loras": max(1, len(set(names) - {BASE_NAME})),
              "max_lora_rank": max(ranks, default=1)}
    base = current if current is not None else EngineConfig()
    if base.enable_lora and base.max_loras >= wanted["max_loras"] and base.max_lora_rank >= wanted["max_lora_rank"]:
        return base
    return dataclasses.replace(base, **wanted)


def row_loras(engine: Engine, model: nn.Module, names: list[str], num_rows: int) -> list[str | None]:
    """Register the call's adapters on the engine, fresh from the LoRA layers (their weights may have
    changed since the last call); return each row's adapter, rows expanded for num_return_sequences."""
    if num_rows % len(names):
        raise ValueError(f"adapter_names has {len(names)} entries for {num_rows} rows")
    for name in dict.fromkeys(names):
        if name == BASE_NAME:
            continue
        engine_name = f"{BASE_NAME}{name}"  # kept apart from adapters the user registered by name
        engine.loras.replace(read_lora_layers(engine_name, model, name, engine.config.max_lora_rank))
    per_row = num_rows // len(names)
    return [None if n == BASE_NAME else f"{BASE_NAME}{n}" for n in names for _ in range(per_row)]


@contextlib.contextmanager
def engine_runs_the_adapters(model: nn.Module) -> Iterator[None]:
    """Set PEFT's per-row hooks aside and let its LoRA layers compute only their base layer; restore both."""
    removed = []
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key, hook in list(hooks.items()):
            if isinstance(hook, functools.partial) and getattr(hook.func, "__name__", "") == HOOK_NAME:
                removed.append((hooks, key, hook, module._forward_pre_hooks_with_kwargs.get(key)))
                del hooks[key]
    layers = lora_layers(model)
    disabled = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield
    finally:
        for layer, value in zip(layers, disabled):
            layer._disable_adapters = value
        for hooks, key, hook, with_kwargs in removed:
            hooks[key] = hook


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "_disable_adapters")]


