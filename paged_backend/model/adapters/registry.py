"""Attention adapters: for architectures whose attention bypasses transformers' attention interface.

An adapter names the attention module classes of one architecture and a paged forward for them.
`install_adapters(model)` binds that forward onto each such module of this model (the class is
left alone, so other models of the same class are untouched). Inside an engine step the module's
cache argument is a `PackedStepCache`: the paged forward computes q/k/v with the module's own
weights, writes K/V through the cache and calls `kernels.paged_attention`. Called any other way
(plain `forward`, `generate`) it runs the module's original forward, so the model still works.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paged_backend.kernels.layer_attention import LayerAttention
from paged_backend.kernels.torch_attention import attend_one
from paged_backend.model.paged import custom_ops
from paged_backend.model.compiled.layer_regions import traced_layer
from paged_backend.model.paged.paged_cache import PackedStepCache, PagedCache, ShapeProbe
from paged_backend.model.paged.recurrent_state import is_all_attention_hybrid

PagedForward = Callable[..., tuple[torch.Tensor, None]]


@dataclass(frozen=True, slots=True)
class Adapter:
    model_type: str
    module_types: tuple[type[nn.Module], ...]  # attention classes whose forward is swapped
    paged_forward: PagedForward  # (module, cache, *args, **kwargs) -> what the original forward returns
    cache_argument: str  # the keyword under which the block hands the module its cache
    prepare: Callable[[nn.Module, object], None] | None = None  # per-module set-up (ALiBi slopes), once
    # True when the paged forward still attends through the interface's "paged_backend" function
    # (it only hands on what the model's own code drops), so the model is switched to it as well.
    uses_interface: bool = False


ADAPTERS: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter) -> Adapter:
    ADAPTERS[adapter.model_type] = adapter
    return adapter


def adapter_for(config: object) -> Adapter | None:
    return ADAPTERS.get(getattr(config, "model_type", None))


def install_adapters(model: nn.Module) -> Adapter | None:
    """Swap in the paged forward on every attention module of `model`'s architecture (idempotent).
    Return the architecture's adapter, or None when it has none or the model needs none (a hybrid family's
    model whose layers are all attention)."""
    adapter = adapter_for(model.config)
    if adapter is None:
        return None
    modules = [m for m in model.modules() if isinstance(m, adapter.module_types)]
    if not modules and is_all_attention_hybrid(model.config.get_text_config()):
        # A hybrid family's model whose layers are all attention (Granite 4.0 Micro, an all-attention LFM2):
        # no recurrent layer to adapt, its attention goes through the interface as any model's.
        return None
    if not modules:
        expected = ", ".join(t.__name__ for t in adapter.module_types)
        raise NotImplementedError(
            f"{type(model).__name__} (model_type={adapter.model_type!r}) has no {expected} module for its "
            "paged adapter: it was built by other code (remote code?); load it with paged_backend.load_model")
    for module in modules:
        if getattr(module, "_paged_original_forward", None) is None:
            if adapter.prepare is not None:
                adapter.prepare(module, model.config)
            module._paged_original_forward = module.forward
            module.forward = functools.partial(dispatch_forward, module, adapter)
    return adapter


def uninstall_adapters(model: nn.Module) -> None:
    """Give every adapted module of `model` its own forward back (a refused model leaves as it came)."""
    for module in model.modules():
        vars(module).pop("_paged_absorbed", None)  # a projection a latent adapter folds in (deepseek_v3.py)
        original = vars(module).pop("_paged_original_forward", None)
        if original is not None:
            del module.forward  # the instance attribute; the class's forward shows through again
            vars(module).pop("_paged_alibi_slopes", None)


def dispatch_forward(module: nn.Module, adapter: Adapter, *args, **kwargs):
    cache = kwargs.get(adapter.cache_argument)
    if isinstance(cache, PackedStepCache):
        rest = {k: v for k, v in kwargs.items() if k != adapter.cache_argument}
        return adapter.paged_forward(module, cache, *args, **rest)
    return module._paged_original_forward(*args, **kwargs)


def attend(
    module: nn.Module,
    cache: PackedStepCache,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's `key/value [T, KVH, D]` through the cache and attend `query [T, H, D]` over
    each sequence's context; returns `[T, H, D]`. `scale` and `alibi_slopes` describe the layer: the start-up
    probe records them as its attention record, which the steps' kernels read (step_context.py)."""
    key, value = cache.update(key.transpose(0, 1)[None], value.transpose(0, 1)[None], module.layer_idx)
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if isinstance(cache, PagedCache):
        return custom_ops.paged_attention(query, key, value, traced_layer(module))
    # The engine's start-up shape probe: one causal sequence, no paged cache yet.
    layer = LayerAttention(scale, alibi_slopes=alibi_slopes)
    if isinstance(cache, ShapeProbe):
        cache.reached(module.layer_idx, "adapter", layer)
    out = attend_one(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), layer)
    return out.transpose(0, 1)


def alibi_slopes_paper(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes `[H]` fp32 (BLOOM, Falcon-RW, Baichuan-13B): a geometric series for
    the largest power of two <= H, then every other slope of the series for twice that many."""
    def series(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = series(closest) + series(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def set_alibi_slopes(module: nn.Module, slopes: torch.Tensor) -> None:
    """Keep the slopes on the module's device, outside its state dict."""
    device = next(module.parameters()).device
    module._paged_alibi_slopes = slopes.to(device=device, dtype=torch.float32)
