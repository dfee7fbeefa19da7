"""`LoRARegistry`: the adapters registered on one base model, by name, read once and kept on the host."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from torch import nn

from paged_backend.model.lora.adapter import LoRAAdapter, LoRARequest, LoRASpec
from paged_backend.model.lora.reading import read_adapter

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
