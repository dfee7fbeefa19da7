"""GPTQ, AWQ and compressed-tensors checkpoints loaded by transformers into this engine's quantized layers.

transformers picks a quantizer by the checkpoint's `quantization_config.quant_method`; its own for these
formats need gptqmodel, autoawq or compressed-tensors, which on a CPU are slow or absent, and build layers the
engine cannot see into (fused projections, compiled regions, LoRA). `install()` (run when paged_backend is
imported) maps the three methods to `CheckpointQuantizer`, so every way in takes such a folder with no flag:
`LLM(folder)`, `paged-backend serve --model folder`, `ChatPaged(model=folder)` and
`AutoModelForCausalLM.from_pretrained(folder)` with `generate(cache_implementation="paged")`. `uninstall()`
gives the methods back to transformers' own quantizers.

The quantizer works as transformers' own do for pre-quantized weights: before the weights load, each linear
layer whose quantized tensors the checkpoint holds (found in the files' headers, whatever the format's
ignore lists say) becomes a `CheckpointTensors` holding buffers of those names, shapes and dtypes, so
transformers' loader fills them as it fills any weight (renames, sharded files, devices); after loading, each
becomes the engine's layer (checkpoint_layers.py). The model stays a transformers model.
"""

from __future__ import annotations

import collections
import copy
import ctypes
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from paged_backend.model.quantized.checkpoint_formats import (
    METHODS,
    CheckpointFormatError,
    CheckpointScheme,
    quant_method_of,
    read_scheme,
    unpack,
)
from paged_backend.model.quantized.checkpoint_layers import build_layer, kernel_name

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                      "F8_E4M3": torch.float8_e4m3fn, "F64": torch.float64}


class CheckpointConfig(QuantizationConfigMixin):
    """A checkpoint's `quantization_config` as written, read into a `CheckpointScheme` (refused by name when
    it is not one this engine reads). Saved back as it was read."""

    def __init__(self, **config: Any) -> None:
        self.raw = copy.deepcopy(config)
        self.quant_method = config.get("quant_method")
        self.scheme: CheckpointScheme = read_scheme(config)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()


class CheckpointTensors(nn.Module):
    """Where transformers' loader puts one quantized linear layer's checkpoint tensors."""

    def __init__(self, linear: nn.Linear, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        for name, (dtype, shape) in tensors.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers(recurse=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a quantized checkpoint's layer ran before its tensors were converted")


class CheckpointQuantizer(HfQuantizer):
    """Loads a GPTQ, AWQ or compressed-tensors checkpoint into the engine's quantized layers."""

    requires_calibration = True  # reads quantized checkpoints; quantizing a float model is quantization="int4"

    def __init__(self, quantization_config: QuantizationConfigMixin, **kwargs: Any) -> None:
        if not isinstance(quantization_config, CheckpointConfig):  # a transformers config object passed in
            quantization_config = CheckpointConfig(**quantization_config.to_dict())
        super().__init__(quantization_config, **kwargs)
        self.scheme: CheckpointScheme = quantization_config.scheme
        self.dtype: torch.dtype | None = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        self.dtype = dtype
        return dtype

    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files: list[str] | None = None,
                                             **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CheckpointFormatError(f"a {self.scheme.method} checkpoint under tensor parallelism: its layers are "
                                        "not split across ranks; load it in one process")
        headers = read_headers(checkpoint_files or [])
        replaced = 0
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear) or f"{name}.{self.scheme.marker}" not in headers:
                continue
            tensors = {suffix: headers[f"{name}.{suffix}"] for suffix in self.scheme.tensor_names
                       if f"{name}.{suffix}" in headers}
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, CheckpointTensors(module, tensors))
            replaced += 1
        if not replaced:
            raise CheckpointFormatError(f"the checkpoint says quant_method={self.scheme.method!r} but no linear layer "
                                        f"of the model has a {self.scheme.marker!r} tensor in its files")

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        kernels: collections.Counter[str] = collections.Counter()
        dtype = self.dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        for name, module in list(model.named_modules()):
            if not isinstance(module, CheckpointTensors):
                continue
            weight = unpack(self.scheme, module.checkpoint_tensors(), module.out_features, module.in_features, name)
            device = next(iter(module.checkpoint_tensors().values())).device
            layer = build_layer(weight, module.bias, dtype, device)
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, layer)
            module._buffers.clear()  # the file's tensors, now in the layer's form: freed as the layers are made
            kernels[kernel_name(layer)] += 1
        release_freed_memory()
        logger.info("quantized checkpoint: %s; %s", self.scheme.describe(),
                    ", ".join(f"{count} linear layers through {kernel}" for kernel, count in kernels.items()))

    @property
    def is_trainable(self) -> bool:
        return False

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        return False  # the engine's layers hold the codes in its kernels' layouts, not the checkpoint's


def release_freed_memory() -> None:
    """Hand the heap pages the conversion freed back to the system (glibc keeps them otherwise, and the
    process's resident memory stays a third above what the model holds)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def read_headers(files: list[str]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every tensor in the checkpoint's safetensors files, from their headers alone."""
    headers = {}
    for file in files:
        if Path(file).suffix != ".safetensors":
            raise CheckpointFormatError(f"{Path(file).name}: quantized checkpoints are read from .safetensors files")
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                dtype = tensor.get_dtype()
                if dtype not in SAFETENSORS_DTYPES:
                    raise CheckpointFormatError(f"{key} has dtype {dtype}, which this engine does not read")
                headers[key] = (SAFETENSORS_DTYPES[dtype], tuple(tensor.get_shape()))
    return headers


def check_quantization_method(config: Any) -> None:
    """CheckpointFormatError for a `quantization_config` whose method no quantizer here knows: transformers
    would warn and load the float layers with random weights in place of the quantized ones."""
    method = quant_method_of(config)
    if getattr(config, "quantization_config", None) is not None and str(method) not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise CheckpointFormatError(f"quantization_config.quant_method={method!r}: no quantizer reads it (this "
                                    f"engine reads {', '.join(METHODS)}; transformers knows "
                                    f"{', '.join(sorted(AUTO_QUANTIZATION_CONFIG_MAPPING))})")


ORIGINALS: dict[str, tuple[Any, Any]] = {}


def install() -> None:
    """Load GPTQ, AWQ and compressed-tensors checkpoints into this engine's layers (idempotent)."""
    for method in METHODS:
        if AUTO_QUANTIZER_MAPPING.get(method) is not CheckpointQuantizer:
            ORIGINALS[method] = (AUTO_QUANTIZER_MAPPING.get(method), AUTO_QUANTIZATION_CONFIG_MAPPING.get(method))
        AUTO_QUANTIZER_MAPPING[method] = CheckpointQuantizer
        AUTO_QUANTIZATION_CONFIG_MAPPING[method] = CheckpointConfig


def uninstall() -> None:
    """Give the three methods back to transformers' own quantizers."""
    for method, (quantizer, config) in ORIGINALS.items():
        AUTO_QUANTIZER_MAPPING[method], AUTO_QUANTIZATION_CONFIG_MAPPING[method] = quantizer, config
    ORIGINALS.clear()


def is_installed() -> bool:
    return all(AUTO_QUANTIZER_MAPPING.get(method) is CheckpointQuantizer for method in METHODS)
