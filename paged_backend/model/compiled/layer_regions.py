"""Decoder layers as nested compile regions: a compiled forward lowers each kind of layer once, not once per layer.

A compiled forward traces the whole model (compilation.py). Traced plainly, inductor lowers every decoder layer
again, which made a cold compile slow (docs/compiled-steps.md has the times). While a graph is traced, `marked()`
routes each decoder layer's call through `run_layer`, a `torch.compiler.nested_compile_region`: dynamo still
traces every layer, but layers whose traced graphs are equal become one subgraph that AOTAutograd and inductor
compile once and call per layer (with that layer's weights as its inputs). Equality is torch's own check on the
traced graphs, so a layer that computes anything differently from the others keeps a subgraph of its own.

One thing made every layer's graph differ: its index, which picks its part of the paged cache and was a
constant in the graph. `index_layers()` gives each module with a `layer_idx` a 0-d tensor of it, and
`traced_layer()` hands that tensor, a graph input like the layer's weights, to the attention while tracing.
Eagerly the index stays a plain int.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

# The attribute holding a module's layer index as a tensor while its forward is compiled.
LAYER_TENSOR = "_paged_layer"


def index_layers(model: nn.Module) -> None:
    """Give every module of `model` with an int `layer_idx` its index as a 0-d CPU tensor (a compiled forward
    reads it as an input; the ops take it to the host, so on the CPU it costs no device sync)."""
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and not isinstance(getattr(module, LAYER_TENSOR, None), torch.Tensor):
            setattr(module, LAYER_TENSOR, torch.tensor(layer))


def traced_layer(module: nn.Module) -> int | torch.Tensor:
    """`module.layer_idx` as the paged ops take it: its tensor while a graph is traced (so layers that differ by
    their index alone trace equal graphs), the int otherwise."""
    if torch.compiler.is_compiling():
        tensor = getattr(module, LAYER_TENSOR, None)
        if tensor is not None:
            return tensor
    return module.layer_idx


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's stack of decoder layers: its longest `nn.ModuleList` of two or more modules of one class
    (empty when it has none)."""
    stacks = [list(m) for m in model.modules()
              if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(child) for child in m}) == 1]
    return max(stacks, key=len, default=[])


@torch.compiler.nested_compile_region
def run_layer(layer: nn.Module, forward, *args, **kwargs):
    """`forward(layer, ...)`, the layer's own forward function, as one region of the traced graph."""
    return forward(layer, *args, **kwargs)


@contextlib.contextmanager
def marked(model: nn.Module) -> Iterator[None]:
    """Route every decoder layer's forward through `run_layer` while the block runs (a graph being traced);
    layers with a forward of their own on the instance (patched by someone else) are left as they are."""
    routed = [layer for layer in decoder_layers(model) if "forward" not in vars(layer)]
    for layer in routed:
        layer.forward = functools.partial(run_layer, layer, type(layer).forward)
    try:
        yield
    finally:
        for layer in routed:
            del layer.forward
