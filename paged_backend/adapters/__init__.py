"""Per-architecture attention adapters (one file each), registered by `config.model_type`.

An architecture whose attention bypasses transformers' attention interface gets a file here that
names its attention module classes, the keyword under which its blocks hand them the cache, and a
paged forward built from the module's own weights (see `registry.py`). The engine calls
`install_adapters(model)`; `model_loader.SUPPORTED` includes every registered type.
"""

from . import baichuan, bloom, falcon, mpt  # noqa: F401  (each registers its adapter)
from .registry import ADAPTERS, Adapter, adapter_for, install_adapters, register_adapter

__all__ = ["ADAPTERS", "Adapter", "adapter_for", "install_adapters", "register_adapter"]
