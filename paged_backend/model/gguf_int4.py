"""A llama GGUF file's Q4_1 tensors read straight into `Int4Linear` layers, with no float round trip.

Q4_1 stores each run of 32 weights as an fp16 scale `d`, an fp16 minimum `m` and 16 bytes of 4-bit
codes (the low nibbles are weights 0-15, the high nibbles 16-31): `w = d * q + m`, which is
`Int4Linear`'s own form, so the codes and their scales are taken as the file has them. transformers'
GGUF loader reorders the rows of the query and key projections (llama.cpp interleaves the rotary
halves); rows hold whole groups, so the same reordering applies to the codes and scales as they are.
Linear layers the file holds in another type are left to the caller.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from paged_backend.model.int4_linear import GROUP_SIZE, Int4Linear

Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes
# GGUF tensor name (llama architecture) -> the HF module path inside model.model.layers[i]
LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def q4_1_codes(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows `[out, in / 32 * 20]` (bytes) -> codes `[out, in]` (uint8), scales and minima `[out, in / 32]` (fp32)."""
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def rotary_rows(num_heads: int, rows: int) -> torch.Tensor:
    """transformers' reordering of a llama GGUF query/key projection's rows, as an index: HF row r is
    GGUF row index[r]. Within each head llama.cpp's order is (pair, half); HF's is (half, pair)."""
    head_dim = rows // num_heads
    order = torch.arange(rows).view(num_heads, head_dim // 2, 2)
    return order.transpose(1, 2).reshape(rows)


def read_q4_1_linears(gguf: Path, model: torch.nn.Module) -> dict[str, Int4Linear]:
    """The `Int4Linear` for every llama decoder projection the file stores as Q4_1, by module name."""
    from gguf import GGMLQuantizationType, GGUFReader

    config = model.config.get_text_config()
    if config.model_type != "llama":
        return {}
    reader = GGUFReader(str(gguf))
    layers: dict[str, Int4Linear] = {}
    for tensor in reader.tensors:
        match = BLOCK_NAME.fullmatch(tensor.name)
        if match is None or tensor.tensor_type != GGMLQuantizationType.Q4_1 or match[2] not in LLAMA_NAMES:
            continue
        codes, d, m = q4_1_codes(np.asarray(tensor.data))
        if match[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if match[2] == "attn_q" else config.num_key_value_heads
            order = rotary_rows(heads, codes.shape[0])
            codes, d, m = codes[order], d[order], m[order]
        name = f"model.layers.{match[1]}.{LLAMA_NAMES[match[2]]}"
        linear = model.get_submodule(name)
        if codes.shape != (linear.out_features, linear.in_features) or codes.shape[1] % GROUP_SIZE:
            raise ValueError(f"{gguf.name}: tensor {tensor.name} has shape {tuple(codes.shape)}, but the model's "
                             f"{name} is {linear.out_features} x {linear.in_features}")
        layers[name] = Int4Linear(codes, d, m, linear.bias)
    return layers
