"""Load a causal LM and its tokenizer for the paged engine, and vet its architecture.

The engine swaps its paged attention in through transformers' attention
interface (``ALL_ATTENTION_FUNCTIONS``), or, for an architecture whose attention
bypasses it (BLOOM, MPT, Falcon, Baichuan) or caches a latent (DeepSeek-V3, V3.2), through that architecture's adapter
in ``paged_backend.model.adapters``. ``SUPPORTED`` lists the ``config.model_type``
values of both kinds; everything else is refused up front with a reason, rather
than failing later with wrong outputs. Baichuan, published only as remote code,
is loaded from a local folder without running that code.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    DistributedConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from paged_backend.errors import UnsupportedArchitectureError
from paged_backend.model.adapters import ADAPTERS
from paged_backend.model.adapters.baichuan import is_baichuan, load_baichuan
from paged_backend.model.paged.attention import ATTENTION_NAME
from paged_backend.model.loading.default_model import (
    DEFAULT_MODEL,
    default_model_path,
    gguf_file_path,
)
from paged_backend.model.loading.precision import preferred_dtype
from paged_backend.model.paged.recurrent_state import is_all_attention_hybrid
from paged_backend.model.quantized.checkpoint_quantizer import check_quantization_method
from paged_backend.model.vision.families import family_of

# Each of these has a decoder-only *ForCausalLM whose attention module calls
# ALL_ATTENTION_FUNCTIONS.get_interface (checked in transformers 5.24's and 5.25's
# models/<name>/modeling_<name>.py), and a tiny model of each gives HF generate's tokens in the mixed-batch test
# (tests/test_engine_equivalence.py). What some need beyond plain causal attention, which the paged
# attention honours: per-layer sliding windows (gemma2, gemma3_text, gemma3, olmo3, exaone4, gpt_oss, cohere2,
# cohere2_moe, ministral, vaultgemma, afmoe, beam, cwm, ergo, exaone_moe, flint, granite_swa, granitemoe_swa,
# kolibri1, laguna, mellum, modernbert-decoder; ministral3 slides on every layer), soft-capping (gemma2,
# gemma3_text), NoPE layers (smollm3, llama4_text, exaone4: the model simply skips the rotary
# embedding), attention sinks (gpt_oss, passed as `s_aux`), chunked attention (llama4_text, read from
# `config.layer_types`; its attention temperature tuning caps the context, model_check.temperature_tuning_limit).
# Some types load another family's class: exaone, internlm3 and iquestcoder a LlamaForCausalLM, param2moe and
# sarvam_moe a Glm4MoeForCausalLM (GPT-SW3's config is a GPT2Config, model_type "gpt2"). Multimodal types:
# llava (LlavaForConditionalGeneration), qwen2_vl and qwen2_5_vl (Qwen2VL- and Qwen2_5_VLForConditionalGeneration,
# M-RoPE positions), idefics3
# (Idefics3ForConditionalGeneration, tiled images) and gemma3 (Gemma3ForConditionalGeneration, Gemma 3 4B and
# larger: image tokens attend both ways) take images (model/vision/families.py); fuyu (FuyuForCausalLM, a
# Persimmon language model) runs on text alone, its images refused.
INTERFACE_TYPES: frozenset[str] = frozenset(
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
        "qwen2_vl",
        "qwen2_5_vl",
        "idefics3",
        "qwen2_moe",
        "granite",
        "olmo",
        "olmo2",
        "starcoder2",
        "phi",
        "cohere",
        "smollm3",
        "gpt_oss",
        "llama4_text",
        "glm4",
        "olmo3",
        "exaone4",
        "ernie4_5",
        "apertus",
        "seed_oss",
        # Admitted after a sweep of every causal-LM type of transformers 5.25 (each tested as the ones above).
        "afmoe",
        "apertus1p5_text",
        "arcee",
        "aria_text",
        "beam",
        "biogpt",
        "bitnet",
        "cohere2",
        "cohere2_moe",
        "ctrl",
        "cwm",
        "ergo",
        "ernie4_5_moe",
        "exaone",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "fuyu",
        "gemma3",
        "glm",
        "glm4_moe",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoeshared",
        "helium",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hyperclovax",
        "internlm3",
        "iquestcoder",
        "jais2",
        "kolibri1",
        "laguna",
        "llava",
        "mellum",
        "minicpm5_moe",
        "minimax_m2",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "modernbert-decoder",
        "nanochat",
        "olmoe",
        "param2moe",
        "persimmon",
        "sarvam_moe",
        "solar_open",
        "vaultgemma",
    }
)

# Architectures whose attention bypasses the interface and runs through an adapter.
ADAPTED_TYPES: frozenset[str] = frozenset(ADAPTERS)

SUPPORTED: frozenset[str] = INTERFACE_TYPES | ADAPTED_TYPES

# Supported types whose forward the engine does not compile (they run eagerly even where it compiles by
# default, on CUDA), with the reason, logged at start-up.
EAGER_TYPES: dict[str, str] = {
    **dict.fromkeys(
        ("qwen2_vl", "qwen2_5_vl"),
        "its language model takes three position axes (M-RoPE) in every step, which the compiled graphs and padded "
        "decode steps do not carry (they take one), so it runs eagerly"),
    "llama4_text": "Llama 4's forward does not compile under the engine's dynamic shapes (inductor fails to lower "
                   "the reshape of its attention output in steps of more than one token), so it runs eagerly",
    "lfm2": "its short-convolution layers run each sequence of a step from its state slot in a Python loop over "
            "the step's sequences (recurrent_state.py), which a graph compiled for every step would not hold, so "
            "it runs eagerly",
    "granitemoehybrid": "its Mamba-2 layers run each sequence of a step from its state slot in a Python loop over "
                        "the step's sequences (recurrent_state.py), which a graph compiled for every step would not "
                        "hold, so it runs eagerly",
    "falcon_h1": "its Mamba-2 mixers run each sequence of a step from its state slot in a Python loop over the "
                 "step's sequences (recurrent_state.py), which a graph compiled for every step would not hold, so "
                 "it runs eagerly",
    "qwen3_next": "its gated delta-net layers run each sequence of a step from its state slot in a Python loop over "
                  "the step's sequences (recurrent_state.py), which a graph compiled for every step would not hold, "
                  "so it runs eagerly",
    "kimi_linear": "its Kimi delta attention layers run each sequence of a step from its state slot in a Python loop "
                   "over the step's sequences (recurrent_state.py), which a graph compiled for every step would not "
                   "hold, so it runs eagerly",
    **dict.fromkeys(
        ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        "its gated delta-net layers run each sequence of a step from its state slot in a Python loop over the step's "
        "sequences (recurrent_state.py), which a graph compiled for every step would not hold, so it runs eagerly"),
}

# Model types users ask about that are refused, with the reason (an unlisted type gets a generic one).
UNSUPPORTED_REASONS: dict[str, str] = {
    "t5": "it is an encoder-decoder model; the paged engine runs decoder-only causal LMs",
    "bart": "it is an encoder-decoder model; the paged engine runs decoder-only causal LMs",
    "mamba": "it is a state-space model with no attention K/V to page",
    "llama4": "it is Llama 4's vision and text checkpoint; load its text model with transformers' "
              "AutoModelForCausalLM.from_pretrained (a Llama4ForCausalLM, model_type 'llama4_text', which is "
              "supported) and pass the loaded model",
    "minimax": "its lightning (linear) attention layers keep a cache class of their own, which the engine's packed "
               "step does not give them; the engine's recurrent state slots hold only short convolutions (lfm2), "
               "Mamba-2 mixers (granitemoehybrid, falcon_h1), gated delta-nets (qwen3_next, qwen3_5) and Kimi delta "
               "attention (kimi_linear)",
    "lfm2_moe": "its short-convolution layers (Lfm2MoeShortConv) have no state-slot adapter yet; lfm2's does not "
                "take them",
    "phimoe": "its sliding window lives only in the mask (transformers builds a sliding-window mask for every layer "
              "from config.sliding_window, and the attention call carries no window), which the paged attention "
              "does not read for this type",
    "doge": "its attention adds an input-dependent mask of its own (dynamic mask attention, prepare_dynamic_mask), "
            "which the paged attention does not compute",
    "jetmoe": "its attention is a mixture of attention experts (MoA), whose keys and values do not have the head "
              "count the paged cache is laid out for",
    **dict.fromkeys(
        ("blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart", "bigbird_pegasus",
         "prophetnet", "trocr", "whisper"),
        "it is the decoder of an encoder-decoder model (its cross-attention reads an encoder's output); the paged "
        "engine runs decoder-only causal LMs"),
    **dict.fromkeys(
        ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
         "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
         "xlm-roberta-xl", "xmod"),
        "it is an encoder (BERT family) with a language-model head, bidirectional unless configured as the "
        "decoder of an encoder-decoder model; the paged engine runs decoder-only causal LMs"),
    **dict.fromkeys(
        ("mamba2", "falcon_mamba", "rwkv", "xlstm"),
        "it is a recurrent (state-space or RNN) model with no attention K/V to page"),
    **dict.fromkeys(
        ("jamba", "bamba", "nemotron_h", "zamba", "zamba2"),
        "it is a hybrid model whose recurrent (Mamba) layers have no state-slot adapter in the engine; the "
        "recurrent state slots serve only lfm2's short convolutions, the Mamba-2 mixers of granitemoehybrid "
        "and falcon_h1, the gated delta-nets of qwen3_next and qwen3_5 and the Kimi delta attention of kimi_linear"),
    **dict.fromkeys(
        ("nemotron", "hrm_text"),
        "its decoder layer does not pass the forward's keywords on to its attention module, so the engine's step "
        "never reaches the attention (StableLM, which does the same, has an adapter that hands the step on; this "
        "type has none)"),
    **dict.fromkeys(
        ("openai-gpt", "xglm", "gpt_neox_japanese", "cpmant"),
        "its attention computes scores itself instead of calling transformers' attention interface, and has no "
        "adapter"),
    **dict.fromkeys(
        ("gemma3n", "gemma3n_text"),
        "its last num_kv_shared_layers layers (10 of 30 in Gemma 3n E2B, 15 of 35 in E4B) compute no keys and values "
        "and write none: they attend over those of the last earlier layer of their kind (KV sharing), which the "
        "paged cache does not map from one layer to another (its per-layer inputs, AltUp and LAuReL run inside the "
        "model's own forward and are not what stops it)"),
    **dict.fromkeys(
        ("mimo_v2_flash", "gemma4_unified_text"),
        "its layers write K/V of different shapes (key/value heads or head size differ between layers), and the "
        "paged cache holds one shape for every layer"),
}

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
}

logger = logging.getLogger(__name__)

# Any of these in a folder means AutoTokenizer can load from it offline.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# Layer types (`config.layer_types` entries) of supported model types that the engine cannot run, with the reason.
UNSUPPORTED_LAYER_TYPES: dict[str, str] = {
    "minimax_m3_sparse": "its sparse-attention layers pick each query's key blocks with a lightning indexer that "
                         "keeps a key cache of its own, which the paged engine does not keep (MiniMax M3 models with "
                         "full-attention layers only run)",
}


def refuse_unsupported_layers(model_or_config: PreTrainedModel | PretrainedConfig, config: PretrainedConfig) -> None:
    """Raise UnsupportedArchitectureError for a config of a supported type with a layer the engine cannot run."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = sorted(set(getattr(text_config, "layer_types", None) or ()) & set(UNSUPPORTED_LAYER_TYPES))
    if found:
        name = _describe_architecture(model_or_config, config)
        raise UnsupportedArchitectureError(
            f"Unsupported configuration of {name} (model_type={config.model_type!r}, layer type {found[0]!r}): "
            f"{UNSUPPORTED_LAYER_TYPES[found[0]]}.")


def check_architecture(model_or_config: PreTrainedModel | PretrainedConfig) -> None:
    """Raise UnsupportedArchitectureError unless the model type is in SUPPORTED and has no layer type it cannot run
    (UNSUPPORTED_LAYER_TYPES)."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None) or "<unknown>"
    if model_type in SUPPORTED:
        refuse_unsupported_layers(model_or_config, config)
        return
    name = _describe_architecture(model_or_config, config)
    reason = UNSUPPORTED_REASONS.get(
        model_type,
        "the paged engine only runs decoder-only causal LMs whose attention goes through "
        "transformers' attention interface or has an adapter",
    )
    raise UnsupportedArchitectureError(
        f"Unsupported architecture {name} (model_type={model_type!r}): {reason}. "
        f"Supported model types: {', '.join(sorted(SUPPORTED))}."
    )


def eager_type_reason(model: PreTrainedModel) -> str | None:
    """Why the engine runs `model` eagerly because of its type (EAGER_TYPES), or None. A hybrid type's model whose
    layers are all attention (Granite 4.0 Micro) has none of the recurrent layers that keep its type eager."""
    if is_all_attention_hybrid(model.config.get_text_config()):
        return None
    return EAGER_TYPES.get(getattr(model.config, "model_type", None))


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


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """Turn ``dtype`` into a torch dtype; None and ``"auto"`` are the device's preferred one (precision.py)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = "auto" if dtype is None else dtype.strip().lower().removeprefix("torch.")
    if name == "auto":
        chosen, why = preferred_dtype(device)
        logger.info("dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    resolved = _DTYPE_ALIASES.get(name, getattr(torch, name, None))
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"Unknown or non-floating dtype {dtype!r}; use e.g. 'float32', 'float16', 'bf16' or 'auto'.")
    return resolved


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
    folder, a path to a ``.gguf`` file, or a loaded model that is used as is (a
    PEFT model: its HF model, with the adapter layers inside).
    With ``tokenizer`` None, the tokenizer comes from the same source; it is None
    when that source is a local folder without tokenizer files.
    """
    model = unwrap_peft(model)
    if isinstance(model, PreTrainedModel):
        if tp_plan is not None:
            raise ValueError("tensor parallelism shards weights while loading them: pass a hub id or a folder, "
                             "not a loaded model")
        check_architecture(model)  # before anything about the caller's model changes
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


def unwrap_peft(model: object) -> object:
    """A PEFT model's transformers model, whose modules hold the adapter layers (LoRA and the like) that
    run in its own forward; anything else unchanged. Prompt-learning adapters (prefix or prompt tuning)
    add virtual tokens outside that model, so they are refused rather than silently dropped."""
    if not (callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")):
        return model
    active = getattr(model, "active_peft_config", None)
    if getattr(active, "is_prompt_learning", False):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} with a {type(active).__name__}: prompt-learning adapters add virtual tokens "
            "outside the transformers model, which the paged engine does not run; LoRA-style adapters are supported")
    return model.get_base_model()


def model_object(model: object) -> PreTrainedModel:
    """The transformers model an engine runs for a model object (a PEFT model's own, with its adapter
    layers); a TypeError naming what was given for anything else."""
    model = unwrap_peft(model)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model={type(model).__module__}.{type(model).__name__}: the engine runs a loaded "
                        "transformers PreTrainedModel or a PEFT model (LLM also takes a hub id, folder or .gguf file)")
    return model


ACCEPTED_MODELS = ("None (the default model), a hub id, a local folder with a config.json, a .gguf file, "
                   "a loaded transformers PreTrainedModel or a PEFT model")
# What a hub id looks like ("name" or "org/name"); anything else is read as a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def is_default_model(model: object) -> bool:
    """Whether a model argument names the bundled default model (None or DEFAULT_MODEL)."""
    return model is None or (isinstance(model, str) and model == DEFAULT_MODEL)


def gguf_file_of(model: object) -> Path | None:
    """The GGUF file a model argument loads from (the default model's bundled one included), or None."""
    if is_default_model(model):
        return gguf_file_path()
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            return path
    return None


def _resolve_source(model: str | os.PathLike | None) -> tuple[str | Path, str | None]:
    """Return (hub id or folder, GGUF file name or None) for a model argument."""
    if is_default_model(model):
        return default_model_path(), None
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model={type(model).__module__}.{type(model).__name__}: expected {ACCEPTED_MODELS}")
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model={os.fspath(model)!r} is a folder without a config.json; expected "
                                    f"{ACCEPTED_MODELS}")
        return path, None
    if path.exists() or path.suffix == ".gguf" or not _HUB_ID.fullmatch(os.fspath(model)):
        found = "a file but not a .gguf file" if path.exists() else "no such folder or .gguf file, and not a hub id"
        raise FileNotFoundError(f"model={os.fspath(model)!r}: {found}; expected {ACCEPTED_MODELS}")
    # Neither a local folder nor a local file: a hub id, handed to the hub as is.
    return os.fspath(model), None


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
    if gguf_name is None and _is_baichuan_folder(source):
        return _load_baichuan_folder(Path(source), dtype, target, attn_implementation, tp_plan)
    extra: dict[str, object] = {"trust_remote_code": trust_remote_code}
    if gguf_name is not None:
        extra["gguf_file"] = gguf_name
    # Refuse unsupported models before paying for their weights.
    config = AutoConfig.from_pretrained(source, **extra)
    check_architecture(config)
    check_quantization_method(config)
    attn_implementation = _attention_to_load(config, attn_implementation)
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    if tp_plan is not None:
        extra["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    else:
        extra["device_map"] = target
    auto = AutoModelForImageTextToText if family_of(config) is not None else AutoModelForCausalLM
    return auto.from_pretrained(source, dtype=_resolve_dtype(dtype, target), **extra)


def _is_baichuan_folder(source: str | Path) -> bool:
    config_file = Path(source) / "config.json"
    return isinstance(source, Path) and config_file.is_file() and is_baichuan(json.loads(config_file.read_text()))


def _load_baichuan_folder(
    folder: Path,
    dtype: torch.dtype | str | None,
    device: torch.device,
    attn_implementation: str | None,
    tp_plan: str | None,
) -> PreTrainedModel:
    """Baichuan without its remote code: the rotary form as a Llama (whose attention implementation
    can be chosen), the ALiBi form as our adapter model (whose attention is the adapter's)."""
    if tp_plan is not None:
        raise NotImplementedError("tensor parallelism is not available for Baichuan checkpoints")
    model = load_baichuan(folder, _resolve_dtype(dtype, device), device)
    if attn_implementation is not None and model.config.model_type == "llama":
        model.set_attn_implementation(attn_implementation)
    return model


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
        if wanted != model.dtype:
            model.to(wanted)
    attn_implementation = _attention_to_load(model.config, attn_implementation)
    # The engine switches an adopted model to the paged attention itself, once it accepts the model,
    # so a model it refuses keeps its own attention.
    if attn_implementation == ATTENTION_NAME:
        return model
    if attn_implementation is not None and attn_implementation != model.config._attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model


def _attention_to_load(config: PretrainedConfig, attn_implementation: str | None) -> str | None:
    """An adapted architecture keeps its own attention code (the adapter swaps the paged one in
    inside the engine only): asking it for the paged interface function would break its own
    forward (MPT's mask, Falcon's attention class table), so that request is dropped, unless its
    adapter attends through the interface function (StableLM)."""
    adapter = ADAPTERS.get(getattr(config, "model_type", None))
    if attn_implementation == ATTENTION_NAME and adapter is not None and not adapter.uses_interface:
        return None
    return attn_implementation


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
    try:
        if _takes_images(source):  # its processor: the tokenizer and what makes images into placeholders
            return AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:
        if not _is_baichuan_folder(source):
            raise
        raise ValueError(
            f"{source}: Baichuan's tokenizer is remote code (a sentencepiece BaichuanTokenizer); its model loads "
            "without that code, but the tokenizer needs trust_remote_code=True (which runs only the tokenizer's "
            "code) or a tokenizer passed as tokenizer="
        ) from exc


def _takes_images(source: str | Path) -> bool:
    """Whether the model at `source` is of a vision family the engine runs images for."""
    try:
        return family_of(AutoConfig.from_pretrained(source)) is not None
    except (OSError, ValueError):
        return False


def _has_tokenizer_files(folder: Path) -> bool:
    """Tell whether ``folder`` is a local folder AutoTokenizer can load from."""
    return folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_FILES)
