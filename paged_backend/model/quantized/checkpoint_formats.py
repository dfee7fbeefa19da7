"""The quantized checkpoint formats people download, read as the files document them: GPTQ, AWQ (GEMM) and
compressed-tensors (`pack-quantized`, `int-quantized`, `float-quantized`).

Each format stores a linear layer's weight as integer (or fp8) codes with a scale, and for the asymmetric
ones a zero point, per group of `group_size` inputs of an output row. Whatever the packing, a weight is

    w[o, i] = (code[o, i] - zero[o, group(i)]) * scale[o, group(i)]

so `unpack` turns one layer's tensors into that one form (`QuantizedWeight`), and the layers that run it
(checkpoint_layers.py) need not know which tool wrote the file. What differs by format:

- GPTQ (AutoGPTQ, GPTQModel): `qweight` int32 `[in * bits / 32, out]` packs codes along the input, lowest
  bits first; `qzeros` int32 `[groups, out * bits / 32]` packs zero points along the output the same way;
  `scales [groups, out]`; `g_idx [in]`, the group of each input, which with `desc_act` (act-order) is not
  `i // group_size`. The format version `gptq` (v1) stores each zero point less one; `gptq_v2` as it is.
- AWQ, GEMM layout (AutoAWQ): `qweight` int32 `[in, out / 8]` packs eight outputs per word in the order
  0, 2, 4, 6, 1, 3, 5, 7; `qzeros` `[groups, out / 8]` likewise; `scales [groups, out]`.
- compressed-tensors `pack-quantized` (llm-compressor's W4A16): `weight_packed` int32 `[out, in * bits / 32]`
  packs signed codes offset by 2^(bits - 1) along the input, lowest bits first; `weight_scale [out, groups]`;
  `weight_zero_point` (asymmetric only) packed the same way along the output. `int-quantized` (W8A16): `weight`
  int8 `[out, in]`. `float-quantized` (FP8): `weight` float8_e4m3fn `[out, in]`, a scale per tensor, per row,
  per group or per 2-D block.

A `quantization_config` this module cannot read exactly (another method, bit width, layout or strategy) is
refused by name at load time, as are a layer's missing or misshapen tensors: never a wrong answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from paged_backend.kernels import cpu_int8_matmul

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each 4-bit slot of an AWQ word holds, lowest bits first
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")


class CheckpointFormatError(ValueError):
    """A quantized checkpoint this engine cannot read exactly: the field or tensor is named."""


@dataclass(frozen=True)
class CheckpointScheme:
    """How one checkpoint stores its quantized linear layers."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    layout: str  # "gptq", "awq", "ct-packed", "ct-int" or "ct-float": which tensors a layer has
    bits: int
    group_size: int  # inputs per scale; -1: one scale per output row (or per tensor, ct-float "tensor")
    symmetric: bool
    zero_minus_one: bool = False  # GPTQ v1 stores each zero point less one
    strategy: str = "group"  # compressed-tensors: "group", "channel", "tensor" or "block"
    block: tuple[int, int] | None = None  # ct-float "block": (output rows, inputs) per scale
    ignore: tuple[str, ...] = ()  # module names or "re:" patterns left in full precision
    # FP8 weights with fp8 activations (llm-compressor's FP8 and FP8_DYNAMIC): run weight-only, the activations
    # in the model's dtype, as weight-only fp8 kernels do where the hardware has no fp8 matmul.
    unquantized_activations: bool = False

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The names (after the module's) a quantized layer's tensors have in the file."""
        return LAYOUT_TENSORS[self.layout]

    @property
    def marker(self) -> str:
        """The tensor whose presence in the file marks a quantized layer (every linear has a `weight`)."""
        return "weight_scale" if self.layout in ("ct-int", "ct-float") else self.tensor_names[0]

    def describe(self) -> str:
        group = "per row" if self.group_size == -1 else f"groups of {self.group_size}"
        kind = "fp8" if self.layout == "ct-float" else f"int{self.bits}"
        zeros = "symmetric" if self.symmetric else "with zero points"
        note = "; its fp8 activations run unquantized" if self.unquantized_activations else ""
        return f"{self.method} ({self.layout}, {kind}, {group}, {zeros}{note})"


LAYOUT_TENSORS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "ct-packed": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    "ct-int": ("weight", "weight_scale", "weight_zero_point"),
    "ct-float": ("weight", "weight_scale", "input_scale"),  # input_scale: static fp8 activations', read, unused
}


@dataclass
class QuantizedWeight:
    """One layer's weight as `(codes - zeros) * scales`, group by group along the input.

    `codes [out, in]`: int16 codes, or the fp8 values themselves for ct-float. `scales`, `zeros [out, groups]`
    fp32 (zeros None where symmetric around 0). `input_order [in]` (act-order only): the inputs sorted by group,
    so that after `x[:, input_order]` group g holds the inputs g * group_size to (g + 1) * group_size - 1."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    bits: int
    input_order: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """fp32 `[out, in]` in the ordered inputs' positions (input_order applied)."""
        return cpu_int8_matmul.dequantize_codes(self.codes, self.scales, self.zeros, self.group_size)


def expand_groups(values: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """`[out, groups]` -> `[out, in]`, each group's value repeated over its inputs."""
    return values.repeat_interleave(group_size, dim=1)[:, :in_features]


def quant_method_of(config: Any) -> str | None:
    """The `quantization_config.quant_method` of a model config, whether transformers kept the dict or made an
    object of it; None without one."""
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        return quantization.get("quant_method")
    return getattr(quantization, "quant_method", None)


def read_scheme(config: dict[str, Any]) -> CheckpointScheme:
    """The scheme a checkpoint's `quantization_config` describes; CheckpointFormatError naming the field
    otherwise."""
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        return read_gptq(config)
    if method == "awq":
        return read_awq(config)
    if method == "compressed-tensors":
        return read_compressed_tensors(config)
    raise CheckpointFormatError(f"quantization_config.quant_method={config.get('quant_method')!r}: this engine reads "
                                f"{', '.join(METHODS)} checkpoints")


def read_gptq(config: dict[str, Any]) -> CheckpointScheme:
    bits = int(config.get("bits", 0))
    if bits not in (2, 4, 8):
        raise CheckpointFormatError(f"GPTQ bits={config.get('bits')!r}: this engine reads 2, 4 and 8 bits (3-bit "
                                    "codes straddle the 32-bit words)")
    checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise CheckpointFormatError(f"GPTQ checkpoint_format={checkpoint_format!r}: this engine reads 'gptq' and "
                                    "'gptq_v2'")
    modules = config.get("modules_to_not_convert") or ()
    return CheckpointScheme("gptq", "gptq", bits, read_group_size(config.get("group_size", 128), "GPTQ"),
                            bool(config.get("sym", True)), zero_minus_one=checkpoint_format == "gptq",
                            ignore=tuple(modules))


def read_awq(config: dict[str, Any]) -> CheckpointScheme:
    bits = int(config.get("bits", config.get("w_bit", 0)))
    version = str(config.get("version", config.get("format", "gemm"))).lower()
    if version != "gemm":
        raise CheckpointFormatError(f"AWQ version={version!r}: this engine reads the GEMM layout")
    if bits != 4:
        raise CheckpointFormatError(f"AWQ bits={bits}: this engine reads 4-bit AWQ")
    group_size = read_group_size(config.get("group_size", config.get("q_group_size", 128)), "AWQ")
    symmetric = not config.get("zero_point", True)
    if symmetric:
        raise CheckpointFormatError("AWQ zero_point=false: the GEMM layout this engine reads has zero points")
    return CheckpointScheme("awq", "awq", bits, group_size, False, ignore=tuple(config.get("modules_to_not_convert")
                                                                               or ()))


def read_group_size(value: Any, method: str) -> int:
    group_size = int(value)
    if group_size != -1 and group_size <= 0:
        raise CheckpointFormatError(f"{method} group_size={value!r}: a positive group size or -1 (per row)")
    return group_size


def read_compressed_tensors(config: dict[str, Any]) -> CheckpointScheme:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointFormatError(f"compressed-tensors config_groups has {len(groups)} groups: this engine reads "
                                    "checkpoints with one scheme for every quantized layer")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    fmt = str(config.get("format") or group.get("format") or "").lower()
    activations = group.get("input_activations")
    if activations and fmt != "float-quantized":
        raise CheckpointFormatError("compressed-tensors input_activations on integer weights (W8A8, W4A8): this "
                                    "engine reads weight-only integer schemes (W4A16, W8A16) and FP8 weights")
    if fmt not in CT_FORMATS:
        raise CheckpointFormatError(f"compressed-tensors format={fmt!r}: this engine reads {', '.join(CT_FORMATS)}")
    kind, bits = str(weights.get("type", "int")).lower(), int(weights.get("num_bits", 0))
    strategy = str(weights.get("strategy", "group")).lower()
    layout = {"pack-quantized": "ct-packed", "int-quantized": "ct-int", "float-quantized": "ct-float"}[fmt]
    expected = {"ct-packed": ("int", (2, 4, 8)), "ct-int": ("int", (8,)), "ct-float": ("float", (8,))}[layout]
    if kind != expected[0] or bits not in expected[1]:
        raise CheckpointFormatError(f"compressed-tensors {fmt} with weights type={kind!r}, num_bits={bits}: "
                                    f"expected type {expected[0]!r} and num_bits in {expected[1]}")
    if strategy not in ("group", "channel", "tensor", "block"):
        raise CheckpointFormatError(f"compressed-tensors weights strategy={strategy!r}: this engine reads group, "
                                    "channel, tensor and block")
    if strategy == "block" and layout != "ct-float":
        raise CheckpointFormatError(f"compressed-tensors {fmt} with strategy 'block': block scales are read for "
                                    "float-quantized weights only")
    group_size = int(weights.get("group_size") or 0) if strategy == "group" else -1
    if strategy == "group" and group_size <= 0:
        raise CheckpointFormatError(f"compressed-tensors strategy 'group' with group_size={weights.get('group_size')!r}")
    block = tuple(weights.get("block_structure") or ()) if strategy == "block" else None
    if strategy == "block" and len(block) != 2:
        raise CheckpointFormatError(f"compressed-tensors block_structure={weights.get('block_structure')!r}: "
                                    "expected [rows, columns]")
    symmetric = bool(weights.get("symmetric", True))
    if layout == "ct-float" and not symmetric:
        raise CheckpointFormatError("compressed-tensors float-quantized with symmetric=false: fp8 weights with zero "
                                    "points are not a format this engine reads")
    return CheckpointScheme("compressed-tensors", layout, bits, group_size, symmetric, strategy=strategy,
                            block=block, ignore=tuple(config.get("ignore") or ()),
                            unquantized_activations=bool(activations))


def unpack(scheme: CheckpointScheme, tensors: dict[str, torch.Tensor], out_features: int, in_features: int,
           module: str) -> QuantizedWeight:
    """One layer's tensors (by their names after the module's) as a QuantizedWeight; CheckpointFormatError
    naming the tensor where one is missing or its shape does not match the layer's `out_features x
    in_features`."""
    reader = {"gptq": unpack_gptq, "awq": unpack_awq, "ct-packed": unpack_ct_packed, "ct-int": unpack_ct_int,
              "ct-float": unpack_ct_float}[scheme.layout]
    return reader(scheme, Tensors(tensors, module), out_features, in_features)


class Tensors:
    """A layer's checkpoint tensors, each checked for presence and shape as it is taken."""

    def __init__(self, tensors: dict[str, torch.Tensor], module: str) -> None:
        self.tensors, self.module = tensors, module

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointFormatError(f"{self.module}.{name} is missing from the checkpoint")
        tensor = self.tensors[name]
        if shape is not None and tuple(tensor.shape) != shape:
            raise CheckpointFormatError(f"{self.module}.{name} has shape {tuple(tensor.shape)}, expected {shape} for "
                                        "this layer's size and the checkpoint's quantization_config")
        return tensor


def unpack_bits(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 `words` -> int16 codes, `32 / bits` per word along `dim`, the lowest bits first. Read through the
    words' bytes (little-endian, as the formats write them), so no wider intermediate than a byte per code is
    made: a checkpoint's layers are unpacked one by one while the whole model is in memory."""
    moved = words.movedim(dim, -1).contiguous()
    data = moved.view(torch.uint8)  # [..., words * 4], byte b of word w at w * 4 + b
    if bits == 8:
        codes = data
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        codes = ((data.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * (32 // bits))
    return codes.movedim(-1, dim).to(torch.int16)


def num_groups(scheme: CheckpointScheme, in_features: int) -> tuple[int, int]:
    """(groups, group size) along the input; per row is one group of every input."""
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    return math.ceil(in_features / group_size), group_size


def packed_length(length: int, bits: int, module: str, what: str) -> int:
    per_word = 32 // bits
    if length % per_word:
        raise CheckpointFormatError(f"{module}: {what} {length} is not a multiple of {per_word} codes per 32-bit word")
    return length // per_word


def unpack_gptq(scheme: CheckpointScheme, tensors: Tensors, out_features: int, in_features: int) -> QuantizedWeight:
    groups, group_size = num_groups(scheme, in_features)
    bits, module = scheme.bits, tensors.module
    qweight = tensors.take("qweight", (packed_length(in_features, bits, module, "in_features"), out_features))
    qzeros = tensors.take("qzeros", (groups, packed_length(out_features, bits, module, "out_features")))
    scales = tensors.take("scales", (groups, out_features))
    codes = unpack_bits(qweight, bits, 0).t()  # [out, in]
    zeros = unpack_bits(qzeros, bits, 1).float() + (1 if scheme.zero_minus_one else 0)  # [groups, out]
    in_order = torch.arange(in_features) // group_size
    group_of = tensors.take("g_idx", (in_features,)).long() if tensors.has("g_idx") else in_order
    if group_of.min() < 0 or group_of.max() >= groups:
        raise CheckpointFormatError(f"{module}.g_idx names groups outside 0..{groups - 1}")
    order = None
    if not torch.equal(group_of, in_order):
        # Act-order: inputs were quantized in another order. Sorted by group they fall into groups of
        # group_size as the kernels expect, which holds only if every group has group_size members.
        if torch.bincount(group_of, minlength=groups)[:-1].ne(group_size).any():
            raise CheckpointFormatError(f"{module}.g_idx: groups of other sizes than {group_size} cannot be reordered")
        order = torch.argsort(group_of, stable=True)
        codes = codes[:, order]
    return QuantizedWeight(codes.contiguous(), scales.float().t().contiguous(), zeros.t().contiguous(), group_size,
                           bits, order)


def unpack_awq(scheme: CheckpointScheme, tensors: Tensors, out_features: int, in_features: int) -> QuantizedWeight:
    groups, group_size = num_groups(scheme, in_features)
    module = tensors.module
    words = packed_length(out_features, 4, module, "out_features")
    codes = awq_columns(unpack_bits(tensors.take("qweight", (in_features, words)), 4, 1))
    zeros = awq_columns(unpack_bits(tensors.take("qzeros", (groups, words)), 4, 1))
    scales = tensors.take("scales", (groups, out_features))
    return QuantizedWeight(codes.t().contiguous(), scales.float().t().contiguous(), zeros.float().t().contiguous(),
                           group_size, 4)


def awq_columns(slots: torch.Tensor) -> torch.Tensor:
    """AWQ's unpacked slots `[rows, out]` (eight per word, lowest bits first) in output-column order."""
    rows, out_features = slots.shape
    ordered = torch.empty_like(slots).view(rows, -1, 8)
    ordered[..., list(AWQ_ORDER)] = slots.view(rows, -1, 8)
    return ordered.view(rows, out_features)


def ct_scales(scheme: CheckpointScheme, tensors: Tensors, out_features: int, in_features: int,
              name: str = "weight_scale") -> tuple[torch.Tensor, int]:
    """A compressed-tensors scale (or zero point) as `[out, groups]` and its group size along the input."""
    if scheme.strategy == "group":
        groups, group_size = num_groups(scheme, in_features)
        return tensors.take(name, (out_features, groups)), group_size
    if scheme.strategy == "channel":
        return tensors.take(name, (out_features, 1)), in_features
    if scheme.strategy == "tensor":
        value = tensors.take(name)
        if value.numel() != 1:
            raise CheckpointFormatError(f"{tensors.module}.{name} has {value.numel()} values; strategy 'tensor' "
                                        "has one")
        return value.reshape(1, 1).expand(out_features, 1), in_features
    rows, cols = scheme.block
    value = tensors.take(name, (math.ceil(out_features / rows), math.ceil(in_features / cols)))
    return value.repeat_interleave(rows, dim=0)[:out_features], cols


def unpack_ct_packed(scheme: CheckpointScheme, tensors: Tensors, out_features: int,
                     in_features: int) -> QuantizedWeight:
    bits, module = scheme.bits, tensors.module
    if tensors.has("weight_shape"):
        shape = tuple(int(v) for v in tensors.take("weight_shape").flatten().tolist())
        if shape != (out_features, in_features):
            raise CheckpointFormatError(f"{module}.weight_shape is {list(shape)}, but the layer is "
                                        f"{out_features} x {in_features}")
    offset = 1 << (bits - 1)  # codes are signed, stored offset by half their range
    packed = tensors.take("weight_packed", (out_features, math.ceil(in_features / (32 // bits))))
    codes = unpack_bits(packed, bits, 1)[:, :in_features]
    scales, group_size = ct_scales(scheme, tensors, out_features, in_features)
    zeros = torch.full(scales.shape, float(offset))
    if not scheme.symmetric:
        words = math.ceil(out_features / (32 // bits))
        stored = tensors.take("weight_zero_point", (words, scales.shape[1]))
        zeros = unpack_bits(stored, bits, 0)[:out_features].float()
    return QuantizedWeight(codes.contiguous(), scales.float().contiguous(), zeros.contiguous(), group_size, bits)


def unpack_ct_int(scheme: CheckpointScheme, tensors: Tensors, out_features: int, in_features: int) -> QuantizedWeight:
    weight = tensors.take("weight", (out_features, in_features))
    if weight.dtype != torch.int8:
        raise CheckpointFormatError(f"{tensors.module}.weight is {weight.dtype}; int-quantized weights are int8")
    scales, group_size = ct_scales(scheme, tensors, out_features, in_features)
    zeros = None
    if not scheme.symmetric:
        zeros = ct_scales(scheme, tensors, out_features, in_features, "weight_zero_point")[0].float().contiguous()
    return QuantizedWeight(weight.to(torch.int16), scales.float().contiguous(), zeros, group_size, 8)


def unpack_ct_float(scheme: CheckpointScheme, tensors: Tensors, out_features: int,
                    in_features: int) -> QuantizedWeight:
    weight = tensors.take("weight", (out_features, in_features))
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointFormatError(f"{tensors.module}.weight is {weight.dtype}; float-quantized weights are "
                                    "float8_e4m3fn")
    scales, group_size = ct_scales(scheme, tensors, out_features, in_features)
    return QuantizedWeight(weight, scales.float().contiguous(), None, group_size, 8)
