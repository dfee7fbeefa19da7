"""Baichuan, published only as remote code, loaded from a local folder without running that code.

Both forms are Llama-shaped (RMSNorm, SiLU-gated MLP, fused `W_pack` = [q; k; v] rows):
- the 7B form (`BaiChuanForCausalLM`, Baichuan2-7B) uses rotary embeddings: it becomes a
  `LlamaForCausalLM` with `W_pack` split into q/k/v;
- the 13B form (Baichuan-13B, Baichuan2-13B) uses ALiBi and no rotary: it becomes
  `BaichuanAlibiForCausalLM` below, whose attention is ALiBi eager attention outside the engine and
  the paged kernels (with ALiBi slopes) inside it.
Baichuan2 normalises its output head rows at run time (NormHead); they are normalised once at load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.initialization import no_init_weights

from paged_backend.model.adapters.registry import (
    Adapter,
    alibi_slopes_paper,
    attend,
    register_adapter,
    set_alibi_slopes,
)
from paged_backend.model.paged.paged_cache import PackedStepCache

MODEL_TYPE = "baichuan"
ARCHITECTURES = ("BaichuanForCausalLM", "BaiChuanForCausalLM")
BAICHUAN2_VOCAB = 125696  # how Baichuan2 (NormHead) is told from Baichuan 1: its vocabulary size


class BaichuanAlibiConfig(LlamaConfig):
    model_type = MODEL_TYPE


class BaichuanAlibiAttention(nn.Module):
    """Baichuan-13B attention: fused `W_pack`, scores `q.k / sqrt(d) + slope * key_pos`, causal."""

    def __init__(self, config: BaichuanAlibiConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.W_pack = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Cache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        batch, tokens, _ = hidden_states.shape
        qkv = self.W_pack(hidden_states).view(batch, tokens, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, D]
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        seq_len = key.shape[2]
        scores = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
        slopes = alibi_slopes_paper(self.num_heads).to(key.device)
        scores = scores + (slopes[:, None, None] * torch.arange(seq_len, device=key.device)).to(scores.dtype)
        q_pos = torch.arange(seq_len - tokens, seq_len, device=key.device)[:, None]
        future = torch.arange(seq_len, device=key.device)[None, :] > q_pos
        scores = scores.masked_fill(future, float("-inf"))
        if attention_mask is not None:  # padding, as an additive or boolean mask over these keys
            mask = attention_mask[..., -seq_len:]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        out = torch.matmul(probs, value).transpose(1, 2).reshape(batch, tokens, -1)
        return self.o_proj(out), None


class BaichuanAlibiForCausalLM(LlamaForCausalLM):
    """A Llama with Baichuan-13B's attention (its rotary embedding is computed and left unused)."""

    config_class = BaichuanAlibiConfig

    def __init__(self, config: BaichuanAlibiConfig) -> None:
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = BaichuanAlibiAttention(config, index)
        self.post_init()


def prepare(module: BaichuanAlibiAttention, config) -> None:
    set_alibi_slopes(module, alibi_slopes_paper(module.num_heads))


def paged_forward(module: BaichuanAlibiAttention, cache: PackedStepCache, hidden_states: torch.Tensor,
                  *args, **kwargs) -> tuple[torch.Tensor, None]:
    tokens = hidden_states.shape[1]
    qkv = module.W_pack(hidden_states[0]).view(tokens, 3, module.num_heads, module.head_dim)
    query, key, value = qkv.unbind(1)
    out = attend(module, cache, query, key, value, module.head_dim ** -0.5, module._paged_alibi_slopes)
    return module.o_proj(out.reshape(1, tokens, -1)), None


ADAPTER = register_adapter(Adapter(MODEL_TYPE, (BaichuanAlibiAttention,), paged_forward, "cache", prepare))


# ---------------------------------------------------------------- loading a checkpoint folder


def is_baichuan(raw_config: dict) -> bool:
    return raw_config.get("model_type") == MODEL_TYPE or any(
        a in ARCHITECTURES for a in raw_config.get("architectures") or ())


def uses_alibi(raw_config: dict) -> bool:
    """The 13B form: `BaichuanForCausalLM` without `max_position_embeddings` (its ALiBi code reads
    `model_max_length` instead). Baichuan-7B is `BaiChuanForCausalLM`; Baichuan2-7B has the field
    and, like every published 7B, hidden size 4096 (the rule vLLM uses)."""
    architectures = raw_config.get("architectures") or ()
    if "BaichuanAlibiForCausalLM" in architectures:  # saved by our own model class
        return True
    rotary = ("BaiChuanForCausalLM" in architectures or "max_position_embeddings" in raw_config
              or raw_config.get("hidden_size") == 4096)
    return not rotary


def llama_config_of(raw_config: dict) -> LlamaConfig:
    max_len = raw_config.get("max_position_embeddings") or raw_config.get("model_max_length") or 4096
    fields = dict(
        vocab_size=raw_config["vocab_size"],
        hidden_size=raw_config["hidden_size"],
        intermediate_size=raw_config["intermediate_size"],
        num_hidden_layers=raw_config["num_hidden_layers"],
        num_attention_heads=raw_config["num_attention_heads"],
        num_key_value_heads=raw_config["num_attention_heads"],
        hidden_act=raw_config.get("hidden_act", "silu"),
        rms_norm_eps=raw_config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=max_len,
        bos_token_id=raw_config.get("bos_token_id", 1),
        eos_token_id=raw_config.get("eos_token_id", 2),
        pad_token_id=raw_config.get("pad_token_id", 0),
        tie_word_embeddings=raw_config.get("tie_word_embeddings", False),
        attention_bias=False,
        mlp_bias=False,
    )
    if uses_alibi(raw_config):
        config = BaichuanAlibiConfig(**fields)
        config.architectures = ["BaichuanForCausalLM"]
        return config
    config = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **fields)
    config.architectures = ["LlamaForCausalLM"]
    return config


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight file of the folder (sharded or not, safetensors or PyTorch pickles, weights only)."""
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            state.update(load_file(file))
        return state
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def convert_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Baichuan names -> the target model's: split `W_pack` for the rotary (Llama) form; normalise
    Baichuan2's head rows (NormHead does it at every forward)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.W_pack.weight") and not isinstance(config, BaichuanAlibiConfig):
            prefix = name[: -len("W_pack.weight")]
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                out[f"{prefix}{part}.weight"] = chunk.contiguous()
        elif name == "lm_head.weight" and config.vocab_size == BAICHUAN2_VOCAB:
            out[name] = nn.functional.normalize(tensor.float()).to(tensor.dtype)
        else:
            out[name] = tensor
    return out


def load_baichuan(folder: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """Build the equivalent model of a Baichuan checkpoint folder and load its weights."""
    raw = json.loads((folder / "config.json").read_text())
    config = llama_config_of(raw)
    config.name_or_path = str(folder)
    model_class = BaichuanAlibiForCausalLM if isinstance(config, BaichuanAlibiConfig) else LlamaForCausalLM
    with no_init_weights():  # every weight is overwritten just below
        model = model_class(config)
    state = convert_state_dict(read_state_dict(folder), config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{folder}: not a Baichuan checkpoint of this form; missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    model.to(device=device, dtype=dtype)
    model.name_or_path = str(folder)
    return model.eval()
