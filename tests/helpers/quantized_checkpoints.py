"""Tiny random models written as the quantizing tools write them (GPTQ, AWQ, compressed-tensors), with the exact
dequantized weights each folder means: the oracle for loaders of quantized checkpoints.

`write_quantized` rounds every `nn.Linear` of the decoder layers to nearest on the format's grid (the rounding is
ours, not GPTQ's or AWQ's search: the point is the file layout, which is the tools'), then writes `config.json` with
the tool's `quantization_config` and `model.safetensors` with the tool's tensor names, dtypes, shapes and bit
layouts. Everything else is saved as the tool saves it: fp16 for GPTQ and AWQ (AutoGPTQ, GPTQModel and AutoAWQ run
and save models in fp16), bf16 for compressed-tensors (llm-compressor keeps the model's dtype, bf16 for today's
models, and gives the scales that dtype: `initialize_qparams` in compressed_tensors/quantization/lifecycle/
initialize.py).

Every scale is rounded up to a bfloat16 value before the weights are rounded to it, then stored in the format's
dtype (fp16 or bf16), which holds it exactly (checked). So an engine that computes with bf16 scales uses the very
scales of the reference, and reproduces it exactly in the symmetric case; rounding up (not to nearest) keeps every
weight inside the grid, so the reference stays within half a step of the float weight.

Formats (`fmt`) and the upstream code each follows:
- "gptq": GPTQ v1 (`checkpoint_format: "gptq"`) as GPTQModel 4.2.5 writes it: `pack_original` in
  gptqmodel/nn_modules/qlinear/__init__.py (= AutoGPTQ's `QuantLinear.pack` in qlinear_cuda.py), zeros stored
  minus one as `convert_gptq_v2_to_v1_format` in gptqmodel/utils/model.py leaves them.
- "awq": AutoAWQ GEMM: `WQLinear_GEMM.from_linear` in awq/modules/linear/gemm.py; config from
  `AwqConfig.to_transformers_dict` in awq/models/_config.py.
- "ct-w4a16", "ct-w8a16": compressed-tensors `pack-quantized` (llm-compressor's W4A16 / W8A16 presets: weight-only
  int of 4 or 8 bits is always packed, `infer_quantization_format` in llm-compressor's
  transformers/compression/quantization_format.py; `PackedQuantizationCompressor` in compressed_tensors/
  compressors/pack_quantized/base.py).
- "ct-w8a8": compressed-tensors `int-quantized` (the INT8 W8A8 preset: `int-quantized` needs input activations,
  `IntQuantizationCompressor.can_compress` in compressors/naive_quantized/base.py).
- "ct-fp8": compressed-tensors `float-quantized` with the FP8 ("tensor"), FP8_DYNAMIC ("channel") or FP8_BLOCK
  ("block") preset of compressed_tensors/quantization/quant_scheme.py.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

FORMATS = ("gptq", "awq", "ct-w4a16", "ct-w8a16", "ct-w8a8", "ct-fp8")
FP8_MAX = 448.0
FP8_BLOCK = 128
# The static input scale written for the FP8 ("tensor") preset, which calibrates one from activations: 2**-6 keeps
# activations up to 7 inside the fp8 range, plenty for these tiny models.
FP8_INPUT_SCALE = 2.0 ** -6
# The versions whose writers these configs mirror.
GPTQMODEL_VERSION = "4.2.5"
COMPRESSED_TENSORS_VERSION = "0.20.1"


def write_quantized(model: PreTrainedModel, folder: Path, fmt: str, *, bits: int = 4, group_size: int = 32,
                    sym: bool = True, desc_act: bool = False, strategy: str = "group",
                    skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Write `model` into `folder` as a `fmt` checkpoint; return {module name: fp32 dequantized weight [out, in]}.

    `bits`: gptq 4 | 8; awq is 4-bit only; the compressed-tensors formats take theirs from the name (ct-w4a16 4,
    ct-w8a16 and ct-w8a8 8, ct-fp8 fp8) and ignore it. `sym`: gptq and the ct int formats; awq is always
    asymmetric, fp8 always symmetric. `group_size`: gptq (-1 per channel; it need not divide in_features, the last
    group is then short, as GPTQ allows), awq, and the ct int formats with strategy "group". `desc_act`: gptq only
    (act-order, here a random column order). `strategy`: compressed-tensors only, "group" | "channel" for int,
    "tensor" | "channel" | "block" for fp8. `skip`: module names left unquantized and named in the config as the
    tool names them."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    if fmt == "awq" and bits != 4:
        raise ValueError("awq: AutoAWQ's GEMM format is 4-bit only")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = torch.float16 if fmt in ("gptq", "awq") else torch.bfloat16
    tensors = {name: t.detach().to(dtype) if t.is_floating_point() else t.detach()
               for name, t in _unique_state(model).items()}
    reference, linears = {}, quantized_linears(model, skip)
    for index, (name, linear) in enumerate(linears.items()):
        del tensors[f"{name}.weight"]
        parts, reference[name] = _quantize(linear.weight.detach().float(), fmt, bits, group_size, sym, desc_act,
                                           strategy, seed=index)
        tensors.update({f"{name}.{key}": value.contiguous() for key, value in parts.items()})
    # GPTQModel and AutoAWQ name the decoder-layer modules they skip; compressed-tensors' ignore list holds every
    # Linear without a scheme, in module order (QuantizationConfig.from_pretrained), the LM head with them.
    left = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in linears]
    skipped = [name for name in quantized_linears(model) if name not in linears]
    _write_config(model, folder, dtype, _quant_config(fmt, bits, group_size, sym, desc_act, strategy,
                                                      left if fmt.startswith("ct-") else skipped))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return reference


def _quantize(weight: torch.Tensor, fmt: str, bits: int, group_size: int, sym: bool, desc_act: bool, strategy: str,
              seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear's tensors in `fmt` (names relative to the module) and the weight they mean."""
    if fmt == "gptq":
        return _gptq_tensors(weight, bits, group_size, sym, desc_act, seed)
    if fmt == "awq":
        return _awq_tensors(weight, group_size)
    if fmt == "ct-fp8":
        return _ct_fp8_tensors(weight, strategy)
    return _ct_int_tensors(weight, 4 if fmt == "ct-w4a16" else 8, group_size, sym, strategy,
                           packed=fmt != "ct-w8a8")


def _quant_config(fmt: str, bits: int, group_size: int, sym: bool, desc_act: bool, strategy: str,
                  unquantized: list[str]) -> dict:
    if fmt == "gptq":
        return _gptq_config(bits, group_size, sym, desc_act, unquantized)
    if fmt == "awq":
        return _awq_config(group_size, unquantized)
    if fmt == "ct-fp8":
        return _ct_fp8_config(strategy, unquantized)
    packing = "int-quantized" if fmt == "ct-w8a8" else "pack-quantized"
    return _ct_int_config(packing, 4 if fmt == "ct-w4a16" else 8, group_size, sym, strategy, unquantized)


def corrupt(folder: Path, drop: str | None = None, set_config: dict | None = None,
            reshape: str | None = None) -> None:
    """Rewrite a written folder wrong: drop every tensor whose name ends with `drop`, merge `set_config` into its
    quantization_config, or give the tensor named `reshape` one more row (a shape no writer makes)."""
    folder = Path(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    if drop is not None:
        dropped = [name for name in tensors if name.endswith(drop)]
        if not dropped:
            raise KeyError(f"no tensor ends with {drop!r}")
        for name in dropped:
            del tensors[name]
    if reshape is not None:
        tensor = tensors[reshape]
        tensors[reshape] = torch.cat([tensor, tensor[:1]]).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if set_config:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["quantization_config"].update(set_config)
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def quantized_linears(model: PreTrainedModel, skip: Collection[str] = ()) -> dict[str, nn.Linear]:
    """The `nn.Linear` modules of the decoder layers (the module list as long as the model has layers), by name,
    less those in `skip`: what the tools quantize when told to leave the LM head alone."""
    layers = model.config.get_text_config().num_hidden_layers
    stacks = [name for name, module in model.named_modules()
              if isinstance(module, nn.ModuleList) and len(module) == layers]
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name not in skip
            and any(name.startswith(f"{stack}.") for stack in stacks)}


def _unique_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict without the second name of a tied tensor (save_pretrained drops it the same way)."""
    seen, state = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor
    return state


def _write_config(model: PreTrainedModel, folder: Path, dtype: torch.dtype, quant_config: dict) -> None:
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    data = config.to_dict()
    data["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True))


# --- rounding -----------------------------------------------------------------------------------------------------

def bf16_up(scale: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= each (positive) fp32 `scale`, as fp32: clear the 16 low bits, rounding up."""
    bits = scale.float().contiguous().view(torch.int32).long()
    return ((bits + 0xFFFF) & ~0xFFFF).to(torch.int32).view(torch.float32)


def _exact_in(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` in `dtype`, refusing a value the dtype cannot hold exactly (an fp16 subnormal, say)."""
    stored = scale.to(dtype)
    if not torch.equal(stored.float(), scale):
        raise ValueError(f"a scale does not round-trip through {dtype}; weights too small for this format")
    return stored


def _round_to_grid(weight: torch.Tensor, groups: torch.Tensor, n_groups: int, qmin: int, qmax: int, sym: bool,
                   zero_min: int | None = None):
    """Round `weight` [out, in] to nearest on a grid of integers qmin..qmax per (row, group), `groups[i]` the group
    of input column i. Symmetric: scale 2*absmax/(qmax-qmin), zero the grid's middle; otherwise scale
    (max-min)/(qmax-qmin) and zero round(qmin - min/scale), min <= 0 <= max so 0 is on the grid (as GPTQ's
    quantizer does). Returns integer codes [out, in], scales [out, groups] (bf16 values) and zeros [out, groups],
    with weight ~ (code - zero[group]) * scale[group]."""
    out, groups = weight.shape[0], groups.long()
    index = groups.expand(out, -1)
    low = torch.zeros(out, n_groups).scatter_reduce(1, index, weight, "amin", include_self=True)
    high = torch.zeros(out, n_groups).scatter_reduce(1, index, weight, "amax", include_self=True)
    if sym:
        absmax = torch.maximum(-low, high)
        absmax = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
        scale = bf16_up(2 * absmax / (qmax - qmin))
        zero = torch.full_like(scale, (qmin + qmax + 1) // 2)
    else:
        span = torch.where(high == low, torch.ones_like(high), high - low)
        scale = bf16_up(span / (qmax - qmin))
        zero = torch.round(qmin - low / scale).clamp(qmin if zero_min is None else zero_min, qmax)
    codes = (torch.round(weight / scale[:, groups]) + zero[:, groups]).clamp(qmin, qmax)
    return codes.long(), scale, zero.long()


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(code - zero) * scale in fp32: exact, since scales are bf16 values and codes small integers."""
    return (codes - zero[:, groups]).float() * scale[:, groups]


def _contiguous_groups(in_features: int, group_size: int) -> torch.Tensor:
    return torch.arange(in_features) // group_size


def _check_divides(size: int, group_size: int, what: str) -> None:
    if size % group_size:
        raise ValueError(f"{what}: group size {group_size} does not divide in_features {size}")


# --- packing ------------------------------------------------------------------------------------------------------

def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `values` [n, m] into int32 [n*bits/32, m]: word r holds rows r*k .. r*k+k-1 (k = 32/bits), row
    r*k+j at bits [bits*j, bits*(j+1)), as in GPTQ's `pack` (qweight)."""
    return pack_columns(values.t(), bits).t()


def pack_columns(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned `values` [n, m] into int32 [n, m*bits/32]: word c holds columns c*k .. c*k+k-1, slot j (bits
    [bits*j, bits*(j+1))) holding column c*k + order[j] (order: the identity unless given, AWQ's interleave)."""
    per_word = 32 // bits
    n, m = values.shape
    if m % per_word:
        raise ValueError(f"{m} values do not fill int32 words of {per_word}")
    if int(values.min()) < 0 or int(values.max()) >= 1 << bits:
        raise ValueError(f"values outside {bits} unsigned bits")
    order = tuple(range(per_word)) if order is None else order
    grouped = values.numpy().astype(np.uint32).reshape(n, m // per_word, per_word)
    words = np.zeros((n, m // per_word), dtype=np.uint32)
    for slot, column in enumerate(order):
        words |= grouped[:, :, column] << np.uint32(bits * slot)
    return torch.from_numpy(words.view(np.int32).copy())


# --- GPTQ ---------------------------------------------------------------------------------------------------------

def _gptq_tensors(weight: torch.Tensor, bits: int, group_size: int, sym: bool, desc_act: bool, seed: int):
    """qweight int32 [in*bits/32, out], qzeros int32 [groups, out*bits/32] (zero - 1: v1), scales fp16 [groups, out],
    g_idx int32 [in]. With act-order, columns are quantized in a random order `perm` (GPTQ's is by Hessian diagonal)
    and g_idx[c] = rank of c in perm // group_size: `g_idx = [i // group_size ...][invperm]` in GPTQ's `fasterquant`
    (gptqmodel/quantization/gptq.py, static_groups off), so g_idx is unsorted and each group has group_size columns.
    Codes are packed along the input dimension, zeros along the output dimension, value j of a word at bits
    [bits*j, bits*(j+1)): `pack_original` in gptqmodel/nn_modules/qlinear/__init__.py (AutoGPTQ's
    `QuantLinear.pack`). v1 stores zero - 1 (`convert_gptq_v2_to_v1_format_module`, gptqmodel/utils/model.py), so
    a zero of 0 cannot be stored: asymmetric zeros are kept >= 1."""
    if bits not in (4, 8):
        raise ValueError("gptq: bits 4 or 8")
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    n_groups = math.ceil(in_features / size)
    if desc_act:
        perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
        groups = (torch.argsort(perm) // size).to(torch.int32)
    else:
        groups = _contiguous_groups(in_features, size).to(torch.int32)
    maxq = (1 << bits) - 1
    codes, scale, zero = _round_to_grid(weight, groups, n_groups, 0, maxq, sym, zero_min=1)
    tensors = {
        "qweight": pack_rows(codes.t(), bits),
        "qzeros": pack_columns(zero.t() - 1, bits),
        "scales": _exact_in(scale.t().contiguous(), torch.float16),
        "g_idx": groups,
    }
    return tensors, _dequantize(codes, scale, zero, groups)


def _gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, skip: list[str]) -> dict:
    """`QuantizeConfig.to_dict` of GPTQModel 4.2.5 (gptqmodel/quantization/config.py) after `save_quantized` set
    its meta (gptqmodel/models/writer.py); a skipped module is a negative `dynamic` rule, as GPTQModel reads them
    (`dynamic_get`: "-:" + a pattern re.match-ed against the module name)."""
    config = {
        "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "lm_head": False,
        "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
        "meta": {"quantizer": [f"gptqmodel:{GPTQMODEL_VERSION}"], "uri": "https://github.com/modelcloud/gptqmodel",
                 "damp_percent": 0.05, "damp_auto_increment": 0.01, "static_groups": False,
                 "true_sequential": True, "mse": 0.0, "v2": False, "v2_alpha": 0.25, "act_group_aware": False},
    }
    if skip:
        config["dynamic"] = {f"-:{re.escape(name)}$": {} for name in skip}
    return config


# --- AWQ ----------------------------------------------------------------------------------------------------------

# AutoAWQ packs eight 4-bit values per int32 with slot j holding column AWQ_ORDER[j] of the eight
# (`order_map` in `WQLinear_GEMM.from_linear`, awq/modules/linear/gemm.py; AWQ_ORDER in awq/utils/packing_utils.py).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq_tensors(weight: torch.Tensor, group_size: int):
    """qweight int32 [in, out/8], qzeros int32 [groups, out/8] (the zero itself, no offset), scales fp16
    [groups, out], both packed along the output dimension in AWQ's interleaved order; w = (q - zero) * scale
    (`dequantize_gemm`, awq/utils/packing_utils.py). AutoAWQ's GEMM is 4-bit, asymmetric (`zero_point: true`)."""
    in_features = weight.shape[1]
    _check_divides(in_features, group_size, "awq")
    groups = _contiguous_groups(in_features, group_size)
    codes, scale, zero = _round_to_grid(weight, groups, in_features // group_size, 0, 15, sym=False)
    tensors = {
        "qweight": pack_columns(codes.t().contiguous(), 4, AWQ_ORDER),
        "qzeros": pack_columns(zero.t().contiguous(), 4, AWQ_ORDER),
        "scales": _exact_in(scale.t().contiguous(), torch.float16),
    }
    return tensors, _dequantize(codes, scale, zero, groups)


def _awq_config(group_size: int, skip: list[str]) -> dict:
    """`AwqConfig.to_transformers_dict` (awq/models/_config.py), what AutoAWQ puts in config.json (its own
    quant_config.json, with w_bit / q_group_size, is not written: loaders read config.json)."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
            "modules_to_not_convert": skip or None}


# --- compressed-tensors ---------------------------------------------------------------------------------------------

def _ct_int_tensors(weight: torch.Tensor, bits: int, group_size: int, sym: bool, strategy: str, packed: bool):
    """Signed codes -2^(bits-1) .. 2^(bits-1)-1 with w = (q - zero_point) * scale (compressed-tensors `dequantize`),
    scale [out, groups] ([out, 1] per channel) in bf16; zero_point only when asymmetric.
    packed ("pack-quantized"): weight_packed int32 [out, in*bits/32], code + 2^(bits-1) (the unsigned offset of
    `pack_to_int32`, compressors/pack_quantized/helpers.py), element i of a row at bits i*bits of the row's
    bitstream (word i*bits//32, little end first); weight_shape int64 [out, in]; weight_zero_point int8 codes packed
    the same way along the output dimension (`pack_to_int32(zero_point, num_bits, packed_dim=0)`), int32
    [out*bits/32, groups]. Otherwise ("int-quantized"): weight int8 [out, in], weight_zero_point int8 [out, groups]."""
    out_features, in_features = weight.shape
    if strategy == "channel":
        groups, n_groups = torch.zeros(in_features, dtype=torch.long), 1
    elif strategy == "group":
        _check_divides(in_features, group_size, "compressed-tensors")
        groups, n_groups = _contiguous_groups(in_features, group_size), in_features // group_size
    else:
        raise ValueError(f"compressed-tensors int: strategy 'group' or 'channel', not {strategy!r}")
    offset = 1 << (bits - 1)
    codes, scale, zero = _round_to_grid(weight, groups, n_groups, -offset, offset - 1, sym)
    tensors = {"weight_scale": _exact_in(scale, torch.bfloat16)}
    if packed:
        tensors["weight_packed"] = pack_columns(codes + offset, bits)
        tensors["weight_shape"] = torch.tensor([out_features, in_features], dtype=torch.int64)
        if not sym:
            tensors["weight_zero_point"] = pack_rows(zero + offset, bits)
    else:
        tensors["weight"] = codes.to(torch.int8)
        if not sym:
            tensors["weight_zero_point"] = zero.to(torch.int8)
    return tensors, _dequantize(codes, scale, zero, groups)


def _ct_fp8_tensors(weight: torch.Tensor, strategy: str):
    """weight float8_e4m3fn [out, in] = fp8(w / scale), w = fp8 value * scale; weight_scale bf16: [1] ("tensor"),
    [out, 1] ("channel"), [ceil(out/128), ceil(in/128)] ("block", 128x128 blocks). The "tensor" preset (FP8) also
    quantizes inputs with a static scale: input_scale bf16 [1]."""
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"ct-fp8: strategy 'tensor', 'channel' or 'block', not {strategy!r}")
    absmax = _fp8_absmax(weight.abs(), strategy)
    scale = bf16_up(torch.where(absmax == 0, torch.ones_like(absmax), absmax) / FP8_MAX)
    spread = _fp8_spread(scale, weight.shape, strategy)
    codes = (weight / spread).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    tensors = {"weight": codes, "weight_scale": _exact_in(scale, torch.bfloat16)}
    if strategy == "tensor":
        tensors["input_scale"] = torch.tensor([FP8_INPUT_SCALE], dtype=torch.bfloat16)
    return tensors, codes.float() * spread


def _fp8_absmax(magnitude: torch.Tensor, strategy: str) -> torch.Tensor:
    """The largest |w| per scale: [1], [out, 1] or [row blocks, column blocks] (the last blocks may be partial)."""
    if strategy == "tensor":
        return magnitude.amax().reshape(1)
    if strategy == "channel":
        return magnitude.amax(dim=1, keepdim=True)
    out_features, in_features = magnitude.shape
    rows, cols = math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[:out_features, :in_features] = magnitude
    return padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK).amax(dim=(1, 3))


def _fp8_spread(scale: torch.Tensor, shape: torch.Size, strategy: str) -> torch.Tensor:
    """Each weight's scale, [out, in]."""
    if strategy != "block":
        return scale.expand(shape)
    blocks = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return blocks[:shape[0], :shape[1]]


def _ct_config(fmt: str, weights: dict, input_activations: dict | None, ignore: list[str]) -> dict:
    """config.json's quantization_config as `ModelCompressor.update_config` writes it (compressed-tensors 0.20.1,
    compressors/model_compressors/model_compressor.py): the QuantizationConfig dump, every module of the one group
    compressed in `fmt` (infer_model_format sets the group's format), `ignore` the Linear modules left float."""
    return {
        "version": COMPRESSED_TENSORS_VERSION, "quant_method": "compressed-tensors", "sparsity_config": {},
        "transform_config": {},
        "config_groups": {"group_0": {"format": fmt, "input_activations": input_activations,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": fmt, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
        "moe_sparsity_config": None, "quantization_status": "compressed",
    }


def _ct_int_config(fmt: str, bits: int, group_size: int, sym: bool, strategy: str, ignore: list[str]) -> dict:
    """W4A16 / W8A16 (weights only) or INT8 W8A8 (dynamic per-token int8 inputs), with the weights asked for."""
    weights = {"dynamic": False, "group_size": group_size if strategy == "group" else None, "num_bits": bits,
               "strategy": strategy, "symmetric": sym, "type": "int"}
    inputs = None
    if fmt == "int-quantized":
        inputs = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True,
                  "type": "int"}
    return _ct_config(fmt, weights, inputs, ignore)


def _ct_fp8_config(strategy: str, ignore: list[str]) -> dict:
    """The FP8 ("tensor", static per-tensor inputs), FP8_DYNAMIC ("channel", dynamic per-token inputs) or
    FP8_BLOCK ("block", 128x128 weight blocks, dynamic inputs in groups of 128) preset."""
    weights = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": strategy, "symmetric": True,
               "type": "float"}
    inputs = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True,
              "type": "float"}
    if strategy == "tensor":
        inputs = {"dynamic": False, "group_size": None, "num_bits": 8, "observer": "static_minmax",
                  "strategy": "tensor", "symmetric": True, "type": "float"}
    elif strategy == "block":
        weights["block_structure"] = [FP8_BLOCK, FP8_BLOCK]
        inputs = {**inputs, "strategy": "group", "group_size": FP8_BLOCK}
    return _ct_config("float-quantized", weights, inputs, ignore)
