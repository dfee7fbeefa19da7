"""Load a causal LM and its tokenizer for the paged engine, and vet its architecture.

The engine swaps its paged attention in through transformers' attention
interface (``ALL_ATTENTION_FUNCTIONS``), so it can only run decoder-only models
whose attention module dispatches through that interface. ``SUPPORTED`` lists
the ``config.model_type`` values checked against the installed transformers
source; everything else is refused up front with a reason, rather than failing
later with wrong outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DistributedConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from paged_backend.default_model import DEFAULT_MODEL, default_model_path

# Each of these has a decoder-only *ForCausalLM whose attention module calls
# ALL_ATTENTION_FUNCTIONS.get_interface (checked in transformers 5.24's
# models/<name>/modeling_<name>.py).
SUPPORTED: frozenset[str] = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "gpt2",
        "gpt_neox",
        "gptj",
        "gpt_bigcode",
        "opt",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
        "granite",
        "olmo",
        "olmo2",
        "stablelm",
        "starcoder2",
        "phi",
        "cohere",
    }
)

UNSUPPORTED_REASONS: dict[str, str] = {
    "bloom": "it adds ALiBi position biases inside its own attention code, outside transformers' attention interface",
    "mpt": "it adds ALiBi position biases inside its own attention code, outside transformers' attention interface",
    "falcon": (
        "its attention calls scaled_dot_product_attention directly (with optional ALiBi biases), "
        "outside transformers' attention interface"
    ),
}

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
}

# Any of these in a folder means AutoTokenizer can load from it offline.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UnsupportedArchitectureError(ValueError):
    """The model's architecture cannot run on the paged engine."""


def check_architecture(model_or_config: PreTrainedModel | PretrainedConfig) -> None:
    """Raise UnsupportedArchitectureError unless the model type is in SUPPORTED."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None) or "<unknown>"
    if model_type in SUPPORTED:
        return
    name = _describe_architecture(model_or_config, config)
    reason = UNSUPPORTED_REASONS.get(
        model_type,
        "the paged engine only runs decoder-only causal LMs whose attention goes through "
        "transformers' attention interface",
    )
    raise UnsupportedArchitectureError(
        f"Unsupported architecture {name} (model_type={model_type!r}): {reason}. "
        f"Supported model types: {', '.join(sorted(SUPPORTED))}."
    )


def _describe_architecture(model_or_config: object, config: object) -> str:
    """Return the model class name, read from the model, the config or the auto mapping."""
    if isinstance(model_or_config, PreTrainedModel):
        return type(model_or_config).__name__
    architectures = getattr(config, "architectures", None)
    if architectures:
        return architectures[0]
    model_type = getattr(config, "model_type", None)
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, type(config).__name__)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """Return ``device``, defaulting to CUDA when available."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype | str:
    """Turn ``dtype`` into a torch dtype (or ``"auto"``), defaulting by device."""
    if dtype is None:
        return _default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.strip().lower().removeprefix("torch.")
    if name == "auto":
        return "auto"
    resolved = _DTYPE_ALIASES.get(name, getattr(torch, name, None))
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"Unknown or non-floating dtype {dtype!r}; use e.g. 'float32', 'float16', 'bf16' or 'auto'.")
    return resolved


def _default_dtype(device: torch.device) -> torch.dtype:
    """Return bfloat16 on CUDA (float16 on GPUs without it) and float32 elsewhere."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_model(
    model: str | os.PathLike | PreTrainedModel | None = None,
    tokenizer: str | PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    tp_plan: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load (or adopt) a causal LM and its tokenizer, in eval mode, checked for support.

    ``model`` is None or DEFAULT_MODEL (the bundled SmolLM2), a hub id or local
    folder, a path to a ``.gguf`` file, or a loaded model that is used as is.
    With ``tokenizer`` None, the tokenizer comes from the same source; it is None
    when that source is a local folder without tokenizer files.
    """
    if isinstance(model, PreTrainedModel):
        if tp_plan is not None:
            raise ValueError("tensor parallelism shards weights while loading them: pass a hub id or a folder, "
                             "not a loaded model")
        loaded = _adopt_model(model, dtype, device, attn_implementation)
        # Only a local folder counts: guessing hub ids would mean network access.
        source = Path(model.name_or_path) if model.name_or_path else None
        gguf_name = None
    else:
        source, gguf_name = _resolve_source(model)
        loaded = _load_pretrained(source, gguf_name, dtype, device, attn_implementation, trust_remote_code, tp_plan)
    loaded.eval()
    check_architecture(loaded)
    return loaded, _load_tokenizer(tokenizer, source, gguf_name, trust_remote_code)


def _resolve_source(model: str | os.PathLike | None) -> tuple[str | Path, str | None]:
    """Return (hub id or folder, GGUF file name or None) for a model argument."""
    if model is None or model == DEFAULT_MODEL:
        return default_model_path(), None
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.parent, path.name
    # Local folders become Paths; anything else is handed to the hub as is.
    return (path if path.is_dir() else os.fspath(model)), None


def _load_pretrained(
    source: str | Path,
    gguf_name: str | None,
    dtype: torch.dtype | str | None,
    device: str | torch.device | None,
    attn_implementation: str | None,
    trust_remote_code: bool,
    tp_plan: str | None = None,
) -> PreTrainedModel:
    """Check the config first (cheap), then load the weights straight onto the device (or, with a
    tensor-parallel plan, this process's shard of them)."""
    target = _resolve_device(device)
    extra: dict[str, object] = {"trust_remote_code": trust_remote_code}
    if gguf_name is not None:
        extra["gguf_file"] = gguf_name
    # Refuse unsupported models before paying for their weights.
    check_architecture(AutoConfig.from_pretrained(source, **extra))
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    if tp_plan is not None:
        extra["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    else:
        extra["device_map"] = target
    return AutoModelForCausalLM.from_pretrained(source, dtype=_resolve_dtype(dtype, target), **extra)


def _adopt_model(
    model: PreTrainedModel,
    dtype: torch.dtype | str | None,
    device: str | torch.device | None,
    attn_implementation: str | None,
) -> PreTrainedModel:
    """Use an in-memory model as is, moving it only where explicitly asked."""
    if device is not None and not _same_device(torch.device(device), model.device):
        model.to(device)  # nn.Module.to works in place, so the caller's object is returned
    if dtype is not None:
        wanted = _resolve_dtype(dtype, model.device)
        if wanted != "auto" and wanted != model.dtype:
            model.to(wanted)
    if attn_implementation is not None and attn_implementation != model.config._attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model


def _same_device(wanted: torch.device, actual: torch.device) -> bool:
    """Treat an index-less device ("cuda") as matching any index of that type."""
    return wanted.type == actual.type and (wanted.index is None or wanted.index == actual.index)


def _load_tokenizer(
    tokenizer: str | PreTrainedTokenizerBase | None,
    source: str | Path | None,
    gguf_name: str | None,
    trust_remote_code: bool,
) -> PreTrainedTokenizerBase | None:
    """Return the given tokenizer, or load one from the model's source if it has one."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    if gguf_name is not None:
        return AutoTokenizer.from_pretrained(source, gguf_file=gguf_name, trust_remote_code=trust_remote_code)
    if source is None or (isinstance(source, Path) and not _has_tokenizer_files(source)):
        return None
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def _has_tokenizer_files(folder: Path) -> bool:
    """Tell whether ``folder`` is a local folder AutoTokenizer can load from."""
    return folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_FILES)
