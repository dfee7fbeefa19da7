"""StableLM: its attention module goes through the attention interface, but its decoder layer calls
that module without the forward's extra keywords, so the engine's step (`paged_cache=`) never
reaches the attention function, which would then attend over the step's own tokens only. The
module does receive the cache, so the adapter hands that cache on as the step."""

from __future__ import annotations

from transformers.models.stablelm.modeling_stablelm import StableLmAttention

from paged_backend.model.adapters.registry import Adapter, register_adapter
from paged_backend.model.paged.paged_cache import PackedStepCache


def paged_forward(module: StableLmAttention, cache: PackedStepCache, *args, **kwargs):
    return module._paged_original_forward(*args, cache=cache, paged_cache=cache, **kwargs)


ADAPTER = register_adapter(Adapter("stablelm", (StableLmAttention,), paged_forward, "cache", uses_interface=True))
