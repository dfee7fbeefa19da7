"""PagedCache: the paged K/V tensors, as a `transformers.Cache` the model writes into.

An unmodified HF attention module calls `cache.update(key, value, layer_idx)` and then the
registered attention function. `update` hands the step's new K/V back as they are; the attention
function writes them into their slots through `slot_mapping` and reads each sequence's context
through the block tables, in one custom op (custom_ops.py) that reads the step's metadata and this
cache from the step context (step_context.py), which the model runner opens around each forward. (A layer whose
attention never reaches that function would leave its K/V unwritten: the start-up probe refuses
such a model, check_every_layer_driven.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from paged_backend.core.kv_cache_groups import CacheGroups, one_group
from paged_backend.core.layer_specs import FullAttentionSpec, LayerSpec, StateSpec, spec_of
from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.kernels.kv_quant import SCALE_DTYPE
from paged_backend.kernels.layer_attention import LayerAttention
from paged_backend.model.paged.recurrent_state import state_layout


@dataclass(frozen=True, slots=True)
class KVShape:
    """The K/V a model keeps: the row of one head that each layer keeping rows writes per token (one shape for every
    such layer), and each layer's spec (core/layer_specs.py: what a layer of its kind keeps, and for how long).
    `parallel`: the specs of recurrent mixers that run beside a layer's attention (Falcon-H1's Mamba-2 beside each
    attention), which keep a state slot where their layer's own spec keeps rows."""

    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    parallel: tuple[LayerSpec, ...] = ()
    # Each layer's attention as the probe recorded it (its scale, window, soft-cap, sinks, ...: the record every
    # step's kernels read, step_context.py); None for a layer without one (a hybrid's recurrent layer); () when
    # not probed.
    attention: tuple[LayerAttention | None, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def planes(self) -> int:
        """Rows stored per token, head and layer: K and V (2), or the one latent row (1). The probe lets every layer
        that keeps rows keep one kind of row."""
        return max((spec.planes for spec in self.layers), default=2)

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        """Every layer's spec, and every mixer's beside a layer's attention."""
        return self.layers + self.parallel

    @property
    def prefix_caching(self) -> bool:
        """Whether every layer and mixer lets a request take a cached prefix's blocks."""
        return all(spec.prefix_caching for spec in self.specs)

    @property
    def needs_state_slots(self) -> bool:
        """Whether each request holds a state slot (a hybrid model's recurrent layers or mixers)."""
        return any(spec.needs_state_slot for spec in self.specs)

    def plane_bytes(self, dtype: torch.dtype) -> int:
        """One token's row of one plane, every head, stored as `dtype` (int8: plus a scale per head)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_kv_heads * (self.head_dim * elem + (SCALE_DTYPE.itemsize if dtype == torch.int8 else 0))

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """One block of every layer, rows stored as `dtype`."""
        plane = self.plane_bytes(dtype)
        return sum(spec.bytes_per_block(plane, block_size) for spec in self.layers)


def uniform_shape(num_layers: int, num_kv_heads: int, head_dim: int,
                  spec: LayerSpec = FullAttentionSpec()) -> KVShape:
    """`num_layers` layers of one spec (full attention unless given)."""
    return KVShape(num_kv_heads, head_dim, (spec,) * num_layers)


class PackedStepCache(Cache):
    """What transformers asks of a cache around one packed step: there is no single sequence length
    (position_ids are always given), and the mask, if any, covers the step's own tokens only."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0


class PagedCache(PackedStepCache):
    """`dtype` is what the cache stores, which may be below the model's precision: a float dtype,
    or int8 with one fp32 scale per (layer, k/v, head, slot) in `kv_scales`.

    `groups` (kv_cache_groups.py) lays layers out on pages of `groups.group_size` layers: layer `l` is
    `kv[groups.layer_position[l]]`, read through its group's block tables. None: every layer on every
    block, `kv[l]`. `null_block`, when given, is a page no step writes, zeroed: the entry of a block a
    window group freed. The runner crops window groups' tables past such entries, so no kernel reads it;
    zeroed, it would hold finite keys if one did."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, groups: CacheGroups | None = None, null_block: int | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = groups or one_group(shape.num_layers)
        self.null_block = null_block
        positions = self.groups.group_size
        # [layer, k/v, kv_head, slot, head_dim]: a head's slots are contiguous, so the CPU gather of
        # one sequence is one index_select per layer and a Triton tile of one block is one stride.
        # A latent cache has one plane where others have k/v (KVShape.planes).
        # `empty`, not `zeros`: unwritten slots are never read (every read is bounded by seq_lens),
        # and untouched pages cost no resident memory.
        self.kv = torch.empty(
            positions, shape.planes, shape.num_kv_heads, num_blocks * block_size, shape.head_dim,
            dtype=dtype, device=device,
        )
        self.kv_scales = None if dtype != torch.int8 else torch.empty(
            positions, shape.planes, shape.num_kv_heads, num_blocks * block_size, dtype=SCALE_DTYPE, device=device)
        if null_block is not None:
            null = slice(null_block * block_size, (null_block + 1) * block_size)
            self.kv[:, :, :, null] = 0
            if self.kv_scales is not None:
                self.kv_scales[:, :, :, null] = 0

    @property
    def grouped(self) -> bool:
        """Whether layers read their own group's block tables and cache positions (else every layer reads the one
        table, layer `l` at `kv[l]`): several groups, a window group, or a hybrid's group of its attention layers."""
        return self.groups.num_groups > 1 or self.groups.frees_blocks or not self.groups.every_layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hand the new K/V `[1, KVH, T, D]` back unwritten: the attention function that receives them
        writes them into their slots and attends, in one op (custom_ops.py)."""
        return key_states, value_states

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.num_blocks * self.block_size


class ShapeProbe(PackedStepCache):
    """Records, from one tiny forward, the K/V shape each layer writes and whether the engine's step
    reached that layer's attention (and by which route), so any architecture (multi-query, grouped,
    per-layer head dims) sizes its paged cache from what it really does, and a layer that would
    silently bypass the paged attention is caught before anything runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[int, int, torch.dtype]] = {}
        self.routes: dict[int, str] = {}  # layer -> "interface", "adapter" or "recurrent" (a hybrid's mixer)
        self.attention: dict[int, LayerAttention] = {}  # layer -> what its attention computes, as it said
        self.latent_value_dims: dict[int, int] = {}  # layer -> its latent's value width, for a latent cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.seen[layer_idx] = (key_states.shape[1], key_states.shape[3], key_states.dtype)
        return key_states, value_states

    def reached(self, layer_idx: int, route: str, attention: LayerAttention | None = None) -> None:
        """Called by the paged attention function or an adapter when the probe's step got to them, with what the
        layer's attention computes (None: a recurrent mixer's layer): the record the engine's steps attend with,
        whose window or chunk its cache group is planned by."""
        self.routes[layer_idx] = route
        if attention is not None:
            self.attention[layer_idx] = attention

    def layer_attention(self, num_layers: int) -> tuple[LayerAttention | None, ...]:
        """The attention record of each of `num_layers` layers (None where the probe met no attention)."""
        return tuple(self.attention.get(layer) for layer in range(num_layers))

    def stores_latent(self, layer_idx: int, value_dim: int) -> None:
        """Called by a latent-attention adapter: the layer caches one latent row per token (what it handed
        `update` as its key), whose first `value_dim` entries are its value."""
        self.latent_value_dims[layer_idx] = value_dim


def probe_model(model: torch.nn.Module) -> ShapeProbe:
    """Run one token through the model with a probe as both its cache and the engine's step."""
    probe = ShapeProbe()
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.zeros_like(ids), cache=probe, use_cache=True, paged_cache=probe)
    except (UnsupportedArchitectureError, NotImplementedError):
        raise
    except Exception as exc:  # noqa: BLE001  (a layer that needs more of the cache than the engine gives)
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}): its forward failed "
            f"on the engine's one-token probe ({type(exc).__name__}: {exc}); some layer needs more from its cache "
            "than the paged engine provides, so it is refused") from exc
    return probe


def probe_kv_shape(model: torch.nn.Module, num_layers: int) -> KVShape:
    """Probe the model, check that every layer writes its K/V through the cache and attends through
    the engine's step, and return the K/V shape the layers hand to the cache."""
    probe = probe_model(model)
    check_every_layer_driven(model, probe, num_layers)
    shapes = {(h, d) for h, d, _ in probe.seen.values()}
    if len(shapes) != 1:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: the paged cache needs every one of its {num_layers} layers to write "
            f"K/V of one shape; saw shapes (kv_heads, head_dim) {sorted(shapes)}"
        )
    (heads, head_dim), = shapes
    latent = set(probe.latent_value_dims.values())
    # A hybrid's recurrent layers keep no rows (Kimi Linear's KDA layers beside its latent ones): every layer that
    # keeps any caches a latent, or none does.
    if latent and (len(latent) > 1 or set(probe.latent_value_dims) != set(probe.seen)):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: the paged cache needs every layer to cache one kind of row; layers "
            f"{sorted(probe.latent_value_dims)} of {num_layers} cache a latent (value widths {sorted(latent)})")
    states = state_layout(model.config.get_text_config()) or {}
    return KVShape(heads, head_dim, tuple(layer_spec(probe, layer, states.get(layer, ())) for layer in range(num_layers)),
                   parallel=tuple(spec_of(keeps_rows=False, states=states[layer]) for layer in sorted(states) if layer in probe.seen),
                   attention=probe.layer_attention(num_layers))


def layer_spec(probe: ShapeProbe, layer: int, states: tuple[StateSpec, ...]) -> LayerSpec:
    """The spec of what `layer` keeps, from what the probe saw it do (core/layer_specs.spec_of): whether it wrote
    rows (a recurrent layer, checked by check_every_layer_driven, writes none), a latent, and the window or chunk
    its attention record holds."""
    attention = probe.attention.get(layer)
    return spec_of(keeps_rows=layer in probe.seen, latent_value_dim=probe.latent_value_dims.get(layer),
                   window=attention.window if attention is not None else None,
                   chunk=attention.chunk if attention is not None else None, states=states)


def check_every_layer_driven(model: torch.nn.Module, probe: ShapeProbe, num_layers: int) -> None:
    """Refuse, naming the layer, a model where some layer does not write K/V through the cache or
    whose attention did not receive the engine's step: that layer would attend over the step's
    own tokens only and produce wrong text without any error."""
    for layer in range(num_layers):
        if probe.routes.get(layer) == "recurrent" and layer not in probe.seen:
            continue  # a hybrid model's recurrent mixer: its state lives in state slots, not K/V
        if layer not in probe.seen:
            reason = "never wrote its keys and values through the cache"
        elif layer not in probe.routes:
            reason = ("wrote K/V but its attention never received the engine's step (its decoder layer does "
                      "not pass forward keywords on to the attention module); it needs an adapter")
        else:
            continue
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}): "
            f"{attention_module_name(model, layer)} {reason}; the paged engine refuses it rather than run it wrong"
        )
    extra = sorted(set(probe.seen) - set(range(num_layers)))
    if extra:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: layers {extra} wrote K/V beyond the config's {num_layers} layers")


def attention_module_name(model: torch.nn.Module, layer: int) -> str:
    """`layer 3 (model.layers.3.self_attn, LlamaAttention)`, or `layer 3` when no module says so."""
    for name, module in model.named_modules():
        if getattr(module, "layer_idx", None) == layer and "attention" in type(module).__name__.lower():
            return f"layer {layer} ({name}, {type(module).__name__})"
    return f"layer {layer}"
