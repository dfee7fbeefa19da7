"""Per-architecture attention adapters (one file each), registered by `config.model_type`.

An architecture whose attention bypasses transformers' attention interface gets a file here that
names its attention module classes, the keyword under which its blocks hand them the cache, and a
paged forward built from the module's own weights (see `registry.py`), or, for an architecture whose
attention does use the interface but whose code drops the engine's step on the way (StableLM), a
forward that hands the step on, or (DeepSeek-V3, DeepSeek-V3.2) whose attention caches a compressed latent that the paged
cache stores as it is. The engine calls
`install_adapters(model)`; `model_loader.SUPPORTED` includes every registered type.
"""

from paged_backend.model.adapters import (  # noqa: F401  (each registers its adapter)
    baichuan,
    bloom,
    deepseek_v3,
    deepseek_v32,
    falcon,
    falcon_h1,
    granitemoehybrid,
    kimi_linear,
    lfm2,
    mpt,
    qwen3_5,
    qwen3_next,
    stablelm,
)
from paged_backend.model.adapters.registry import (
    ADAPTERS,
    Adapter,
    adapter_for,
    install_adapters,
    register_adapter,
    uninstall_adapters,
)

__all__ = ["ADAPTERS", "Adapter", "adapter_for", "install_adapters", "register_adapter", "uninstall_adapters"]
