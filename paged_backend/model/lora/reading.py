"""Reading a PEFT adapter (a folder or a loaded `PeftModel`) against the base model: its config checked, its A/B
pairs matched to the base's linears, scaled; which linears an adapter may target."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_backend.model.quantized.quantized_linear import QuantizedLinear
from paged_backend.model.lora.adapter import LoRAAdapter, LoRAWeights

_ids = itertools.count(1)  # adapter ids, unique in the process (they key prefix-cache blocks)
_SUPPORTED_KEYS = (".lora_A.weight", ".lora_B.weight")


def read_adapter(name: str, source: Any, model: nn.Module, max_rank: int,
                 adapter_name: str | None = None) -> LoRAAdapter:
    """Read a LoRA adapter from a PEFT folder, a loaded `PeftModel` (its `adapter_name`, by default
    the active one) or `LoRAWeights`, and check it against `model`; ValueError saying what does not fit."""
    if isinstance(source, (str, os.PathLike)):
        config, state = _read_folder(Path(source))
    else:
        weights = portable_source(source, adapter_name, f"add_lora({name!r}, ...): ")
        config, state = weights.config, weights.state
    check_config(name, config)
    weights = {}
    linears = adaptable_linears(model)
    for module_name, (a, b) in _pair_weights(name, state).items():
        linear = _target_linear(name, model, module_name, linears)
        r = a.shape[0]
        if a.shape != (r, linear.in_features) or b.shape != (linear.out_features, r):
            raise ValueError(f"LoRA adapter {name!r} does not match the base model: {module_name} is "
                             f"{linear.in_features} -> {linear.out_features}, the adapter's A is {tuple(a.shape)} "
                             f"and B {tuple(b.shape)} (an adapter trained on another model?)")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {r} at {module_name}, above max_lora_rank={max_rank}")
        dtype = weight_of(linear).dtype
        weights[module_name] = (a.to(dtype).contiguous(), b.to(dtype).contiguous(), _scaling(config, module_name, r))
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} has no LoRA weights")
    return LoRAAdapter(name, next(_ids), weights)


def portable_source(source: Any, adapter_name: str | None = None, context: str = "") -> str | LoRAWeights:
    """`source` in a form another process can read: a folder as its absolute path (that process reads
    the files itself, so the path must exist there too), a `PeftModel` as the `LoRAWeights` of
    `adapter_name` (by default its active adapter). Nothing is checked against a base model here;
    `context` prefixes the TypeError for anything else."""
    if isinstance(source, (str, os.PathLike)):
        return os.path.abspath(os.fspath(source))
    if isinstance(source, LoRAWeights):
        return source
    if callable(getattr(source, "get_base_model", None)) and hasattr(source, "peft_config"):
        return LoRAWeights(*_read_peft_model(source, adapter_name))
    raise TypeError(f"{context}expected a PEFT adapter folder or a PeftModel, got {type(source).__name__}")


def read_lora_layers(name: str, model: nn.Module, adapter_name: str, max_rank: int) -> LoRAAdapter:
    """Adapter `adapter_name` read from the PEFT LoRA layers inside `model` (a PeftModel's own model)."""
    weights = {}
    for module_name, module in model.named_modules():
        if adapter_name in (getattr(module, "lora_embedding_A", None) or {}):
            raise ValueError(f"LoRA adapter {adapter_name!r} adapts an embedding ({module_name}): "
                             "embedding LoRA is not supported")
        if adapter_name not in (getattr(module, "lora_A", None) or {}):
            continue
        if adapter_name in (getattr(module, "lora_variant", None) or {}):
            raise ValueError(f"LoRA adapter {adapter_name!r} at {module_name} is a LoRA variant (e.g. DoRA): "
                             "not supported")
        linear = base_linear(module)
        if not is_linear(linear):
            raise ValueError(f"LoRA adapter {adapter_name!r} targets {module_name}, a {type(linear).__name__}: "
                             f"{ONLY_LINEAR}")
        if linear is output_embedding(model):
            raise ValueError(f"LoRA adapter {adapter_name!r} targets the output embedding ({module_name}): "
                             "not supported")
        a, b = module.lora_A[adapter_name].weight.detach(), module.lora_B[adapter_name].weight.detach()
        if a.shape[0] > max_rank:
            raise ValueError(f"LoRA adapter {adapter_name!r} has rank {a.shape[0]} at {module_name}, above "
                             f"max_lora_rank={max_rank}")
        dtype = weight_of(linear).dtype
        weights[module_name] = (a.to(dtype).clone(), b.to(dtype).clone(),
                                float(module.scaling[adapter_name]))
    if not weights:
        raise ValueError(f"the model has no LoRA layers for adapter {adapter_name!r}")
    return LoRAAdapter(name, next(_ids), weights)


def _read_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
    config = json.loads(config_file.read_text())
    from peft.utils import load_peft_weights

    return config, load_peft_weights(str(path), device="cpu")


def _read_peft_model(model: Any, adapter_name: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    from peft.utils import get_peft_model_state_dict

    adapter_name = adapter_name or model.active_adapter
    if adapter_name not in model.peft_config:
        raise ValueError(f"the PeftModel has no adapter {adapter_name!r}; it has {sorted(model.peft_config)}")
    config = model.peft_config[adapter_name].to_dict()
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return config, {k: v.detach().cpu() for k, v in state.items()}


def check_config(name: str, config: dict) -> None:
    """Refuse the PEFT variants whose delta is not `B @ A * scaling` on a linear layer."""
    peft_type = str(config.get("peft_type", ""))
    if peft_type.split(".")[-1].upper() != "LORA":
        raise ValueError(f"adapter {name!r} is a {peft_type or 'non-PEFT'} adapter: only LoRA adapters are served")
    refusals = {
        "use_dora": "DoRA adapters (use_dora=True) are not supported",
        "lora_bias": "LoRA with a bias on B (lora_bias=True) is not supported",
        "modules_to_save": "adapters that replace whole modules (modules_to_save) are not supported",
        "trainable_token_indices": "adapters with trainable tokens are not supported",
        "target_parameters": "LoRA on parameters (target_parameters) is not supported",
        "layer_replication": "adapters with layer_replication are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) LoRA is not supported",
    }
    for key, message in refusals.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {message}")


def _pair_weights(name: str, state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's saved keys `base_model.model.<module>.lora_A.weight` -> {module: (A, B)}."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if "lora_embedding" in key:
            raise ValueError(f"LoRA adapter {name!r} adapts an embedding ({key}): embedding LoRA is not supported")
        suffix = next((s for s in _SUPPORTED_KEYS if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"LoRA adapter {name!r}: unsupported weight {key!r} (only lora_A/lora_B of linear layers)")
        module = key[: -len(suffix)].removeprefix("base_model.model.")
        halves.setdefault(module, {})[suffix[6]] = tensor
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{next(iter(ab))} without its other half")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _target_linear(name: str, model: nn.Module, module_name: str, linears: dict[str, nn.Module]) -> nn.Module:
    """The linear `module_name` of `model` when an adapter may target it (`linears`, adaptable_linears), else
    ValueError saying why not."""
    if module_name in linears:
        return linears[module_name]
    try:
        module = base_linear(model.get_submodule(module_name))
    except AttributeError:
        raise ValueError(f"LoRA adapter {name!r} does not match the base model ({type(model).__name__}): it targets "
                         f"{module_name}, which this model does not have") from None
    if module is output_embedding(model):
        raise ValueError(f"LoRA adapter {name!r} targets the output embedding ({module_name}): not supported")
    if getattr(module, "_paged_absorbed", False):
        raise ValueError(f"LoRA adapter {name!r} targets {module_name}, whose weight the paged latent attention "
                         "folds into its query and output instead of calling the layer: not supported")
    if is_linear(module):
        raise ValueError(f"LoRA adapter {name!r} targets {module_name}, a part of a PEFT tuner layer: target the "
                         "tuner layer itself")
    raise ValueError(f"LoRA adapter {name!r} targets {module_name}, a {type(module).__name__}: {ONLY_LINEAR}")


def base_linear(module: nn.Module) -> nn.Module:
    """The layer itself, or the base layer a PEFT tuner layer wraps (a base model that is itself a PeftModel)."""
    get_base_layer = getattr(module, "get_base_layer", None)
    return get_base_layer() if callable(get_base_layer) else module


# PEFT's own modules inside a tuner layer: never an adapter's target (the tuner layer is, by its base layer).
_PEFT_PARTS = {"base_layer", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout",
               "lora_magnitude_vector"}


def adaptable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The linears an adapter may target, by module name as adapters name them: every linear layer of
    `model` (a PEFT tuner layer by its base layer) but the output embedding, which sees only the step's
    kept rows, not every token the mask covers, and a projection whose weight a latent-attention adapter folds
    into its query and output (adapters/deepseek_v3.py), whose forward never runs."""
    head = output_embedding(model)
    linears = {}
    for name, module in model.named_modules():
        if _PEFT_PARTS.intersection(name.split(".")):
            continue
        linear = base_linear(module)
        if is_linear(linear) and linear is not head and not getattr(linear, "_paged_absorbed", False):
            linears[name] = linear
    return linears


ONLY_LINEAR = "only linear layers (nn.Linear, or this engine's int4 layers) are supported"


def is_linear(module: nn.Module) -> bool:
    """An `nn.Linear`, or a `QuantizedLinear` (int4 weights): the hook adds the delta to either's output,
    so adapters serve over a quantized base as over its float weights."""
    return type(module) is nn.Linear or isinstance(module, QuantizedLinear)


def weight_of(linear: nn.Module) -> torch.Tensor:
    """The float weight a linear multiplies by in the model's dtype, or for a quantized layer an empty tensor of
    that dtype on its device: what an adapter's A and B are stored like."""
    if isinstance(linear, QuantizedLinear):
        device = next(iter(linear.buffers())).device
        return torch.empty(0, dtype=linear.dense_dtype, device=device)
    return linear.weight


def output_embedding(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return None if head is None else base_linear(head)


def _scaling(config: dict, module_name: str, r: int) -> float:
    """PEFT's scaling: lora_alpha (or its alpha_pattern entry) over r, or over sqrt(r) with rslora."""
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    if patterns:
        from peft.utils.other import get_pattern_key

        alpha = patterns.get(get_pattern_key(patterns.keys(), module_name), alpha)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
