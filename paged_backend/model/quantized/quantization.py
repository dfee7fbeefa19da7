"""Weight-only quantization of a model's linear layers: `LLM(..., quantization="int8" | "int4")`.

int8 is torchao's `Int8WeightOnlyConfig`: each linear weight becomes int8 with one scale per output
channel; activations, embeddings, norms and the KV cache keep the model's dtype. On CPU it decoded
slower than the original weights both eagerly and compiled (docs/precision.md), so it saves memory, not
time, and compiling follows the engine's own `compile` setting.

int4 (CPU only) is `Int4Linear` (int4_linear.py): 4-bit codes with a scale and offset per group of
32 inputs, multiplied by torch's CPU int4 kernel in small steps, which decodes several times faster
than the bf16 or fp32 weights it replaces (docs/precision.md). The decoder's projections
become int4; the output projection (LM head, often tied to the embedding, which keeps its weight)
becomes int8 per row (int8_linear.py). A llama GGUF file's own Q4_1 tensors (the default model's) are
taken as they are (gguf_int4.py); other weights are rounded per group.

A GPTQ, AWQ or compressed-tensors checkpoint is quantized already: it loads into the engine's layers
(checkpoint_quantizer.py) with no option. Naming its method (`quantization="gptq"`) asks for that format:
a folder in another one, or in full precision, is refused rather than run otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from paged_backend.model.quantized.checkpoint_formats import METHODS as CHECKPOINT_FORMATS
from paged_backend.model.quantized.checkpoint_formats import quant_method_of
from paged_backend.model.quantized.int4_linear import Int4Linear, can_quantize
from paged_backend.model.quantized.int8_linear import Int8Linear
from paged_backend.model.quantized.quantized_linear import has_quantized_layers

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4")  # applied by the engine to full-precision weights
CHECKPOINT_METHODS = CHECKPOINT_FORMATS  # read from a quantized checkpoint as it is
AUTO = "auto"  # LLM's default: int4 for the default model where that measured best, else none


def check_method(method: str | None) -> None:
    """ValueError for anything but None, "auto" or a method this engine applies."""
    if method is None or method == AUTO or method in METHODS or method in CHECKPOINT_METHODS:
        return
    choices = ", ".join(map(repr, (AUTO, *METHODS, *CHECKPOINT_METHODS)))
    raise ValueError(f"quantization={method!r}: choose one of {choices} or None")


def check_checkpoint_method(model: torch.nn.Module, method: str) -> None:
    """ValueError unless `model` was loaded from a checkpoint in the format `method` names."""
    found = quant_method_of(model.config)
    if found != method:
        what = f"a {found} checkpoint" if found else "not a quantized checkpoint"
        raise ValueError(f"quantization={method!r} reads a {method} checkpoint, but this model is {what}")


def resolve_method(method: str | None, default_model: bool, device: torch.device, dtype: torch.dtype,
                   single_process: bool, dtype_named: bool = False) -> str | None:
    """What `quantization="auto"` means: int4 for the default model on CPU (its GGUF file's Q4_1 weights,
    as they are), in bf16 (as good as bf16 weights and faster on one stream) or in the fp32 the engine
    picks on a CPU without native bf16 (the int4 kernel is several times faster than fp32 weights there);
    docs/precision.md has the measurements. Not for fp32 the caller named (`dtype_named`: exact weights
    asked for), nor for anything else (a model given, another device, tensor parallelism, which int4
    layers cannot take). LoRA adapters add their deltas to int4 layers as to float ones (model/lora/). Other
    values: themselves."""
    if method != AUTO:
        return method
    precision = dtype == torch.bfloat16 or (dtype == torch.float32 and not dtype_named)
    wanted = default_model and device.type == "cpu" and precision and single_process
    return "int4" if wanted else None


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether the model's weights were already quantized (by a transformers quantizer, torchao or int4 here)."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        return True
    if has_quantized_layers(model):
        return True
    return any(type(p).__module__.startswith("torchao") for p in model.parameters())


def quantize_weights(model: torch.nn.Module, method: str, gguf: Path | None = None) -> None:
    """Quantize the linear layers of `model` in place (weight-only); a clear error if the method's
    library is missing, the device cannot run it, or the model is quantized already. `gguf`: the file
    the model was loaded from, whose Q4_1 tensors int4 takes as they are."""
    check_method(method)
    if is_quantized(model):
        raise ValueError(f"quantization={method!r}: this model's weights are already quantized "
                         f"({type(model).__name__}); load it without quantization= to run it as it is")
    if method == "int4":
        quantize_int4(model, gguf)
        return
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise ImportError(f"quantization={method!r} needs torchao: pip install 'paged-backend[quant]' "
                          "(or pip install torchao)") from exc
    quantize_(model, Int8WeightOnlyConfig())


def quantize_int4(model: torch.nn.Module, gguf: Path | None = None) -> None:
    """Every decoder linear layer the int4 kernel can take becomes an `Int4Linear`, the LM head an
    `Int8Linear` (4 bits lose too much at the output; int8 still reads half the bytes of bf16)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantization='int4' runs on CPU (torch's CPU int4 kernel); this model is on {device}: "
                         "use quantization='int8' or a model quantized by a transformers quantizer")
    head = model.get_output_embeddings()
    targets = {name: module for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module is not head and can_quantize(module)}
    from_file = read_gguf_layers(gguf, model) if gguf is not None else {}
    for name, linear in targets.items():
        replace_module(model, name, from_file.get(name) or Int4Linear.from_float(linear))
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    if type(head) is torch.nn.Linear and head_name is not None:
        # The embedding keeps its own weight where the head was tied to it.
        replace_module(model, head_name, Int8Linear.from_float(head))
    kept = sum(type(m) is torch.nn.Linear for m in model.modules())
    logger.info("quantization int4: %d linear layers (%d from the GGUF file's Q4_1 tensors), the LM head int8, "
                "%d kept as they were", len(targets), len(from_file.keys() & targets.keys()), kept)


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, module)


def read_gguf_layers(gguf: Path, model: torch.nn.Module) -> dict[str, Int4Linear]:
    from paged_backend.model.quantized.gguf_int4 import read_q4_1_linears

    return read_q4_1_linears(gguf, model)
