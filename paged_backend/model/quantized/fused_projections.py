"""Fused projections: a layer's q, k and v projections as one matmul, and its gate and up projections as one.

A Llama-like layer multiplies the same hidden states by three attention projections and two MLP ones: five
activation casts and five kernel calls where two would do (vLLM's merged linear layers). On the default
model's int4 layers the stacked calls took less time than the projections one by one (docs/compiled-steps.md
has the measurement); benchmarks/fused_projections.py measures whole one-stream decodes, eager and compiled.

The model's code is not changed: transformers' attention still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`.
Inside an engine step (`step()`), the first of a group's projections called with `x` multiplies `x` by the
group's stacked weight once (`FusedGroup`: dense, torchao's per-row int8 or this engine's int4 weights),
returns its own columns and keeps the others for the next calls with the same `x`; a call with another
input (a model that feeds its projections differently) computes afresh, so the values are the projections'
own in every case. Outside a step (`forward`, `generate`, training) each projection runs its own forward.

The stacked weight is the engine's own, and the projections' weights become views of it: dense weights
through `.data`, so each parameter keeps its identity and an in-place update of one (`load_state_dict`, an
optimizer step) updates the stack; torchao int8 weights as new parameters over views of the stacked codes,
scales and zero points (`.data` cannot swap a tensor subclass's contents). So no weight is held twice, and
`state_dict()` and `save_pretrained` see the same names, shapes and values. Int4 layers share their codes
and dense copy the same way; their per-group scales are kept twice (an eighth of a byte per weight, under
5 % of the layer's memory), since the int4 kernel reads them as one contiguous `[groups, out, 2]` block,
which a column slice is not.

A LoRA hook on a projection still adds its delta: the hook runs on the projection's own call, with its
input, on the columns it returns. Under PEFT's tuner layers the base layers are fused: a tuner layer adds its
adapters' deltas to its base layer's output, whichever adapters are on. Not fused (and logged): tensor
parallelism (each rank's shards pass through transformers' own hooks), weights of other kinds (other torchao
tensors, int8 with activation quantization), and projections that differ in input size, dtype, device or bias,
or whose int4 rows the kernel's packing cannot stack (it packs rows in blocks).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paged_backend.model.paged.step_context import current
from paged_backend.kernels.cpu_int4_matmul import TILE, TiledWeight
from paged_backend.model.quantized.int4_linear import Int4Linear, packed_rows_stack

logger = logging.getLogger(__name__)

# (parent module attribute names that hold the projections) for each fused group, in output order.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

class DenseStack:
    """The stacked weight (and bias) of dense projections: `F.linear` once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(eq=False)
class FusedGroup:
    """One layer's stacked projections: `stack(x)` is every member's output side by side, `sizes` wide each.
    `both` holds the stack's output for `input` while members have yet to take their columns (`served`: a
    bit per member that took them). A member's second call for one input computes again: a LoRA hook has
    added its delta to the columns it took, in place."""

    stack: nn.Module | DenseStack
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    members: tuple[nn.Module, ...]
    scale_versions: tuple[int, ...]  # int4 members' scales_and_zeros versions when stacked (the stack copies them)
    input: torch.Tensor | None = None
    both: torch.Tensor | None = None
    served: int = 0

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x`: its columns of the stack's output for `x`, computed once per input.
        Called about 150 times per step of the default model: integer bits, not lists, keep it cheap."""
        bit = 1 << index
        if self.input is not x or self.served & bit:
            self.both, self.input, self.served = self.stack(x), x, 0
        self.served |= bit
        # narrow, not split: a LoRA hook adds its delta in place, which a view from split refuses under autograd.
        out = self.both.narrow(-1, self.offsets[index], self.sizes[index])
        if self.served == (1 << len(self.sizes)) - 1:
            self.input = self.both = None  # every member served: hold nothing between layers
        return out


def member_forward(group: FusedGroup, index: int, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    context = current()
    if context is not None and context.fused:
        return group.output(index, x)
    return module._paged_unfused_forward(x)


@dataclass(frozen=True, slots=True)
class FusionReport:
    groups: int  # fused groups (2 per Llama-like layer)
    skipped: dict[str, str]  # a group's parent module name -> why it was not fused

    def describe(self) -> str:
        reasons = sorted(set(self.skipped.values()))
        text = f"{self.groups} groups of projections fused"
        return text + (f"; {len(self.skipped)} left unfused ({'; '.join(reasons)})" if reasons else "")


def fuse_projections(model: nn.Module) -> FusionReport:
    """Fuse every group of projections in `model` that can be. A group fused before is kept while its members'
    weights are still views of its stack, and fused anew when they are not (a weight replaced since)."""
    fused, skipped = 0, {}
    for parent_name, parent in model.named_modules():
        for names in GROUPS:
            members = [projection(getattr(parent, name, None)) for name in names]
            if not all(isinstance(m, nn.Module) for m in members):
                continue
            if all(is_fused(m) for m in members) and group_intact(members):
                fused += 1
                continue
            for member in members:
                unfuse(member)
            reason = refusal(members)
            if reason is None:
                fuse_group(members)
                fused += 1
            else:
                skipped[f"{parent_name}.{'/'.join(names)}"] = reason
    return FusionReport(fused, skipped)


def fusion_intact(model: nn.Module) -> bool:
    """Whether every fused group of `model` still computes its members: each member's weights still views of
    the stack (not replaced by new tensors: `model.to(...)`, `load_state_dict(assign=True)`) and an int4
    member's scales unchanged since they were stacked."""
    for parent in model.modules():
        for names in GROUPS:
            members = [projection(getattr(parent, name, None)) for name in names]
            if any(isinstance(m, nn.Module) and is_fused(m) for m in members) and not group_intact(members):
                return False
    return True


def projection(module: nn.Module | None) -> nn.Module | None:
    """The layer that holds a projection's weights: itself, or the base layer under PEFT's tuner layers. A tuner
    layer calls its base layer with the projection's input and adds its adapters' deltas to what comes back, so
    the base layers of q, k and v stack as plain projections do; and a base layer fused before PEFT wrapped it
    is found (and unfused when its weights were replaced: `model.to(torch.bfloat16)`)."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def is_fused(module: nn.Module) -> bool:
    return "_paged_unfused_forward" in vars(module)


def group_of(module: nn.Module) -> FusedGroup:
    return vars(module)["forward"].args[0]


def group_intact(members: list[nn.Module]) -> bool:
    if not all(isinstance(m, nn.Module) and is_fused(m) for m in members):
        return False
    group = group_of(members[0])
    if any(group_of(m) is not group for m in members) or list(group.members) != members:
        return False
    return all(views_rows(group, m, start, size) for m, start, size in zip(members, group.offsets, group.sizes))


def views_rows(group: FusedGroup, member: nn.Module, start: int, size: int) -> bool:
    """Whether `member`'s weights are the rows `start:start + size` of the group's stack, as fused."""
    stack = group.stack
    if isinstance(stack, DenseStack):
        pairs = [(member.weight, stack.weight)] + ([(member.bias, stack.bias)] if stack.bias is not None else [])
        if is_torchao_int8(stack.weight):
            if not is_torchao_int8(member.weight):
                return False
            pairs[0:1] = [(getattr(member.weight, name), getattr(stack.weight, name)) for name in INT8_ROWS
                          if getattr(stack.weight, name, None) is not None]
    else:
        pairs = [(getattr(member, name), getattr(stack, name)) for name in ("dense", "packed")
                 if getattr(stack, name) is not None]
        if stack.bias is not None:
            pairs.append((member.bias, stack.bias))
        if scale_version(member) != group.scale_versions[group.members.index(member)]:
            return False
        if stack.tiles is not None:  # rows of 16 outputs (the int4 kernel's tiles)
            tile_pairs = zip(member.tiles or (), stack.tiles)
            if member.tiles is None or not all(is_row_view(part, whole, start // TILE, size // TILE)
                                               for part, whole in tile_pairs):
                return False
    return all(is_row_view(part, whole, start, size) for part, whole in pairs)


def is_row_view(part: torch.Tensor, whole: torch.Tensor, start: int, size: int) -> bool:
    return (part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and part.data_ptr() == whole[start:start + size].data_ptr() and part.shape == whole[start:start + size].shape
            and part.dtype == whole.dtype)


def groups_of(model: nn.Module) -> list[FusedGroup]:
    """The fused groups in `model`, one per group."""
    found = {id(group_of(m)): group_of(m) for m in model.modules() if is_fused(m)}
    return list(found.values())


def refusal(members: list[nn.Module]) -> str | None:
    """Why these projections cannot be fused, or None."""
    if any("forward" in vars(m) for m in members):
        return "a projection's forward is replaced already"
    kinds = {type(m) for m in members}
    if kinds == {nn.Linear}:
        weights = [m.weight for m in members]
        if all(is_torchao_int8(w) for w in weights):
            if any(not per_row_int8(w) for w in weights):
                return "torchao int8 weights with a zero point, activation quantization or other than per-row scales"
        elif any(type(w) not in (torch.Tensor, nn.Parameter) for w in weights):
            return (f"weights of kind {type(weights[0]).__name__} (plain tensors, torchao's per-row int8 tensors and "
                    "int4 layers are fused)")
        if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
            return "projections of different input sizes, dtypes or devices"
        if len({m.bias is None for m in members}) != 1:
            return "some projections have a bias and others not"
        return None
    if kinds == {Int4Linear}:
        if len({(m.in_features, m.dense_dtype, m.bias is None, m.dense is None) for m in members}) != 1:
            return "int4 projections of different input sizes, dense dtypes, biases or dense copies"
        orders = [m.input_order for m in members]
        if any(o is None for o in orders) != all(o is None for o in orders) or (
                orders[0] is not None and any(not torch.equal(o, orders[0]) for o in orders)):
            return "int4 projections whose inputs are in different orders (act-order checkpoints)"
        tiles_only = members[0].packed is None  # a checkpoint's layer: its tiles stack by 16 rows
        if not tiles_only and not packed_rows_stack([m.out_features for m in members], members[0].in_features):
            return "the int4 kernel packs rows in blocks these projections' sizes do not align with"
        return None
    return f"projections of kinds {sorted(k.__name__ for k in kinds)} (plain linear layers or int4 layers are fused)"


def fuse_group(members: list[nn.Module]) -> None:
    """Stack the members' weights into a group, make theirs views of it and swap in the group's forward."""
    sizes = tuple(m.out_features for m in members)
    offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    with torch.no_grad():
        stack = Int4Linear.stacked(members) if isinstance(members[0], Int4Linear) else dense_stack(members)
        for member, start, size in zip(members, offsets, sizes):
            share_rows(member, stack, start, size)
    versions = tuple(scale_version(m) if isinstance(m, Int4Linear) else 0 for m in members)
    group = FusedGroup(stack, sizes, offsets, tuple(members), versions)
    for index, member in enumerate(members):
        member._paged_unfused_forward = member.forward
        member.forward = functools.partial(member_forward, group, index, member)


def scale_version(member: Int4Linear) -> int:
    """The version of an int4 member's scales (the stack holds its own copy, so an in-place change unfuses)."""
    scales = member.scales_and_zeros if member.scales_and_zeros is not None else member.tile_scales
    return scales._version


def is_torchao_int8(weight: torch.Tensor) -> bool:
    """torchao's int8 weight-only tensor (`quantization="int8"`), by name: torchao is optional."""
    return type(weight).__name__ == "Int8Tensor" and type(weight).__module__.startswith("torchao")


INT8_ROWS = ("qdata", "scale", "zero_point")  # a torchao int8 weight's tensors with a row per output row


def per_row_int8(weight: torch.Tensor) -> bool:
    """An int8 weight with a scale (and zero point) per output row and no activation quantization: its rows
    stack as they are."""
    extras = ("act_quant_scale", "act_quant_zero_point", "act_pre_scale", "act_quant_kwargs")
    rows = [getattr(weight, name, None) for name in INT8_ROWS]
    return (all(getattr(weight, name, None) is None for name in extras)
            and list(weight.block_size) == [1, weight.shape[1]]
            and all(t is None or t.shape[0] == weight.shape[0] for t in rows))


def int8_rows(like: torch.Tensor, rows: slice | None = None, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
    """A torchao int8 tensor like `like`: its rows `rows`, as views, or `parts` stacked."""
    tensors = {}
    for name in INT8_ROWS:
        if getattr(like, name, None) is None:
            continue
        tensors[name] = getattr(like, name)[rows] if parts is None else torch.cat([getattr(p, name) for p in parts])
    qdata = tensors.pop("qdata")
    return type(like)(qdata, tensors.pop("scale"), [1, qdata.shape[1]], like.dtype, **tensors)


def dense_stack(members: list[nn.Linear]) -> DenseStack:
    first = members[0].weight
    if is_torchao_int8(first):
        weight = int8_rows(first, parts=[m.weight for m in members])
    else:
        weight = torch.cat([m.weight.detach() for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
    return DenseStack(weight, bias)


def share_rows(member: nn.Module, stack: nn.Module | DenseStack, start: int, size: int) -> None:
    """Make `member`'s weight tensors the rows `start:start + size` of the stack's."""
    if isinstance(stack, DenseStack):
        if is_torchao_int8(stack.weight):
            # A new parameter: `.data` cannot swap a tensor subclass's contents (a quantized model built for the
            # engine, whose parameters no optimizer holds).
            rows = int8_rows(stack.weight, rows=slice(start, start + size))
            member.weight = nn.Parameter(rows, requires_grad=False)
        else:
            member.weight.data = stack.weight[start:start + size]
        if stack.bias is not None:
            member.bias.data = stack.bias[start:start + size]
        return
    for name in ("dense", "packed"):
        if getattr(stack, name) is not None:
            setattr(member, name, getattr(stack, name)[start:start + size])
    if stack.tiles is not None:  # whole tiles: an int4 layer's outputs are a multiple of 16
        member.register_tiles(TiledWeight(*(part[start // TILE:(start + size) // TILE] for part in stack.tiles)))
    if stack.bias is not None:
        member.bias.data = stack.bias[start:start + size]


def unfuse(member: nn.Module) -> None:
    """Give a fused projection its own forward back (its weights stay views of the stack: the same values)."""
    if is_fused(member):
        del member.forward
        del member._paged_unfused_forward


def fuse_for_engine(model: nn.Module, off: str | None = None) -> bool:
    """Fuse `model`'s projections for an engine's steps unless the config turns them `off` (why) or tensor parallelism
    runs; say once what was fused and what was not, and why. Whether any group is fused (the steps then enter
    step())."""
    if off is not None:
        logger.info("fused projections: off (%s)", off)
        return False
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        logger.info("fused projections: not under tensor parallelism (each projection's shard passes through "
                    "transformers' own tensor-parallel hooks)")
        return False
    report = fuse_projections(model)
    logger.info("fused projections: %s", report.describe())
    return report.groups > 0
