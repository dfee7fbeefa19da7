"""A layer's paged cache write and attention, as one registered torch custom op.

`torch.compile` sees the op as one opaque node with a fake (shape-only) implementation, so the
graph around it is compiled while the attention keeps its per-step Python work (the CPU backend
loops over sequences using host lists) and its Triton launches. The op takes tensors and the layer's
index only (in a graph, a 0-d tensor: layer_regions.py). Everything that changes per step (the
`AttentionMetadata`, with its host lists) and the paged cache itself reach it through the step context
(step_context.py), never through its arguments: a compiled graph has nothing step-specific to guard on, so
one graph serves every step, and the cache is never a graph input that the compiler would functionalize (it
copied the whole cache per layer when it was one). What the layer's attention computes (its scale, window,
soft-cap, ALiBi slopes, sinks, chunk) is its attention record (kernels/layer_attention.py), found there by the
index too: a custom op cannot take a dataclass, and the record never changes, so it is no argument at all.

The write and the attention are one op, not two, because the attention must see the keys the write
stored: one op orders them without a data dependency between ops, and costs one dispatch per layer
instead of two (PagedCache.update hands the new K/V to the attention function unwritten).
"""

from __future__ import annotations

import torch

from paged_backend.kernels import write_and_attend
from paged_backend.model.paged.step_context import current_step


def paged_attention_impl(query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor, layer: torch.Tensor
                         ) -> torch.Tensor:
    """Write this step's `new_key/new_value [T, KVH, D]` into layer `layer` of the step's paged cache at
    the step's slot mapping, then attend packed `query [T, H, D]` over each sequence's context there, as the
    layer's attention record says; returns `[T, H, D]`. `layer` is a 0-d CPU tensor inside a compiled graph
    (layer_operand), an int eagerly."""
    metadata, cache, attention = current_step().layer_step(int(layer))
    # A contiguous query gives a contiguous output on every backend, as the fake promises.
    return write_and_attend(query.contiguous(), new_key, new_value, cache, metadata, attention)


paged_attention_op = torch.library.custom_op("paged_backend::paged_attention", paged_attention_impl, mutates_args=())


@paged_attention_op.register_fake
def _(query, new_key, new_value, layer):
    return query.new_empty(query.shape)


# What the model's layers call: the registered op inside a graph being compiled (opaque there), and its
# implementation directly in an eager forward, which skips the dispatcher's per-call overhead, paid once per
# layer per step (docs/compiled-steps.md has the measurement).
def paged_attention(query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor, layer: int | torch.Tensor
                    ) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return paged_attention_op(query, new_key, new_value, layer_operand(layer))
    return paged_attention_impl(query, new_key, new_value, layer)


def layer_operand(layer: int | torch.Tensor) -> torch.Tensor:
    """A layer index as the ops take it in a graph: a tensor, so that the layers' graphs differ in an input, not in a
    constant, and can be one compiled region (layer_regions.py). An int (a module without its index tensor)
    becomes a constant tensor: correct, and that layer keeps a region of its own."""
    return layer if isinstance(layer, torch.Tensor) else torch.tensor(layer)
