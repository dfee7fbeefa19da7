"""A llama GGUF file's Q4_1 tensors read straight into `Int4Linear` layers, with no float round trip.

Q4_1 stores each run of 32 weights as an fp16 scale `d`, an fp16 minimum `m` and 16 bytes of 4-bit
codes (the low nibbles are weights 0-15, the high nibbles 16-31): `w = d * q + m`, which is
`Int4Linear`'s own form, so the codes and their scales are taken as the file has them. transformers'
GGUF loader reorders the rows of the query and key projections (llama.cpp interleaves the rotary
halves); rows hold whole groups, so the same reordering applies to the codes and scales as they are.
Linear layers the file holds in another type are left to the caller.

The file's tensor index is read here (`tensor_index`) rather than through `gguf.GGUFReader`, which
decodes every metadata value, the 49,152-token vocabulary included, at a cost of seconds per start-up
for the default model where this takes a small fraction of that (docs/precision.md).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from paged_backend.model.quantized.int4_linear import GROUP_SIZE, Int4Linear

Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes
# GGUF tensor name (llama architecture) -> the HF module path inside model.model.layers[i]
LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
GGUF_MAGIC = b"GGUF"
Q4_1 = 3  # GGML type id
# Byte sizes of GGUF's fixed-size metadata value types (8: string, 9: array are read apart).
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


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
    config = model.config.get_text_config()
    if config.model_type != "llama":
        return {}
    layers: dict[str, Int4Linear] = {}
    blob = np.memmap(gguf, dtype=np.uint8, mode="r")
    for name, rows, ggml_type, offset in tensor_index(gguf):
        match = BLOCK_NAME.fullmatch(name)
        if match is None or ggml_type != Q4_1 or match[2] not in LLAMA_NAMES:
            continue
        row_bytes = rows[0] // GROUP_SIZE * Q4_1_BLOCK_BYTES
        blocks = blob[offset: offset + row_bytes * rows[1]].reshape(rows[1], row_bytes)
        codes, d, m = q4_1_codes(blocks)
        if match[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if match[2] == "attn_q" else config.num_key_value_heads
            order = rotary_rows(heads, codes.shape[0])
            codes, d, m = codes[order], d[order], m[order]
        module_name = f"model.layers.{match[1]}.{LLAMA_NAMES[match[2]]}"
        linear = model.get_submodule(module_name)
        if codes.shape != (linear.out_features, linear.in_features) or codes.shape[1] % GROUP_SIZE:
            raise ValueError(f"{gguf.name}: tensor {name} has shape {tuple(codes.shape)}, but the model's "
                             f"{module_name} is {linear.out_features} x {linear.in_features}")
        layers[module_name] = Int4Linear(codes, d, m, linear.bias, linear.weight.dtype)
    return layers


def tensor_index(gguf: Path) -> Iterator[tuple[str, tuple[int, ...], int, int]]:
    """(name, dims innermost first, GGML type id, absolute data offset) of every tensor in a GGUF file
    (format versions 2 and 3), skipping the metadata values."""
    with open(gguf, "rb") as f:
        magic, version, num_tensors, num_values = struct.unpack("<4sIQQ", f.read(24))
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{gguf}: not a GGUF file of version 2 or 3")
        alignment = 32
        for _ in range(num_values):
            key = read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            if key == "general.alignment":
                (alignment,) = struct.unpack("<I", f.read(4))
            else:
                skip_value(f, value_type)
        tensors = []
        for _ in range(num_tensors):
            name = read_string(f)
            (dims,) = struct.unpack("<I", f.read(4))
            shape = struct.unpack(f"<{dims}Q", f.read(8 * dims))
            ggml_type, offset = struct.unpack("<IQ", f.read(12))
            tensors.append((name, shape, ggml_type, offset))
        start = -(-f.tell() // alignment) * alignment
    for name, shape, ggml_type, offset in tensors:
        yield name, shape, ggml_type, start + offset


def read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == 8:  # string
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, 1)
    elif value_type == 9:  # array: item type, count, items
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in VALUE_SIZES:
            f.seek(VALUE_SIZES[item_type] * count, 1)
        else:
            for _ in range(count):
                skip_value(f, item_type)
    else:
        f.seek(VALUE_SIZES[value_type], 1)
