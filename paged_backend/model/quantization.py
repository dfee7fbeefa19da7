"""Weight-only quantization of a model's linear layers: `LLM(..., quantization="int8")`, through torchao.

int8 is torchao's `Int8WeightOnlyConfig`: each linear weight becomes int8 with one scale per output
channel; activations, embeddings, norms and the KV cache keep the model's dtype. On an AVX2 CPU it
decoded slower than the original weights both eagerly and compiled (README, "Precision"), so it
saves memory, not time, and compiling follows the engine's own `compile` setting.

int4 is refused: torchao 0.18's `Int4WeightOnlyConfig` has no CPU format (each packing needs CUDA or
an extra kernel library), and torch's own CPU int4 matmul (`_weight_int4pack_mm_for_cpu`) took about
30 ms for one token through a 576 x 1536 layer on an AVX2 CPU, where the fp32 matmul took 0.5 ms.
"""

from __future__ import annotations

import torch

METHODS = ("int8", "int4")


def check_method(method: str | None) -> None:
    """ValueError for anything but None or a method this engine applies."""
    if method is None or method == "int8":
        return
    if method == "int4":
        raise ValueError("quantization='int4' is not supported: torchao has no CPU int4 weight format and torch's "
                         "CPU int4 matmul was measured far slower than fp32 here; use quantization='int8' (a model "
                         "quantized by a transformers quantizer runs as it is)")
    raise ValueError(f"quantization={method!r}: choose one of {', '.join(map(repr, METHODS[:1]))} or None")


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether the model's weights were already quantized (by a transformers quantizer or torchao)."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        return True
    return any(type(p).__module__.startswith("torchao") for p in model.parameters())


def quantize_weights(model: torch.nn.Module, method: str) -> None:
    """Quantize every linear layer of `model` in place (weight-only); a clear error if torchao is
    missing or the model is quantized already."""
    check_method(method)
    if is_quantized(model):
        raise ValueError(f"quantization={method!r}: this model's weights are already quantized "
                         f"({type(model).__name__}); load it without quantization= to run it as it is")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise ImportError(f"quantization={method!r} needs torchao: pip install 'paged-backend[quant]' "
                          "(or pip install torchao)") from exc
    quantize_(model, Int8WeightOnlyConfig())
