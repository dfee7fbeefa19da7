"""The bytes of one KV block in a second tier, and the checks that decide whether they may be used.

A stored block carries everything a reader compares before trusting it: the model's fingerprint (fingerprint.py),
the block's chain hash and its whole key (the parent's hash, the block's token ids, the first block's cache salt),
the shape and dtype of its rows, and a CRC of all of it. A reader that finds any of these different from what it
asked for (another model, another version, a truncated or flipped file, a hash collision) refuses the block: a
hash alone is never trusted.

Layout: magic, a little-endian u32 header length, the header (JSON), then the payload: the K/V rows, and after
them the int8 scales where the cache stores int8; the CRC (u32) of header and payload ends the file.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass

import torch

from paged_backend.kernels.kv_quant import SCALE_DTYPE

MAGIC = b"PBKV1\n"
FORMAT = 1  # bumped whenever the layout changes: an older file is refused by its header


class UntrustedBlock(ValueError):
    """A stored block that must not be used; the message says why (shown once per kind of fault)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass(frozen=True, slots=True)
class StoredKey:
    """What a stored block must match: model, group, chain hash, parent hash, token ids, cache salt."""

    fingerprint: str
    group: int
    block_hash: int
    parent: int | None
    tokens: tuple[int, ...]
    salt: str | None

    def header(self) -> dict:
        return {"format": FORMAT, "fingerprint": self.fingerprint, "group": self.group,
                "hash": f"{self.block_hash:032x}", "parent": None if self.parent is None else f"{self.parent:032x}",
                "tokens": list(self.tokens), "salt": self.salt}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def encode(key: StoredKey, rows: torch.Tensor, scales: torch.Tensor | None) -> list[bytes | memoryview]:
    """The pieces of a block's file, in order (written one after another: no joined copy of the rows)."""
    header = key.header() | {"dtype": str(rows.dtype).removeprefix("torch."), "shape": list(rows.shape),
                             "scales": None if scales is None else list(scales.shape)}
    head = json.dumps(header, separators=(",", ":")).encode()
    pieces: list[bytes | memoryview] = [MAGIC, struct.pack("<I", len(head)), head, tensor_bytes(rows)]
    if scales is not None:
        pieces.append(tensor_bytes(scales))
    crc = 0
    for piece in pieces[2:]:
        crc = zlib.crc32(piece, crc)
    pieces.append(struct.pack("<I", crc))
    return pieces


def decode(data: bytes | bytearray, key: StoredKey, dtype: torch.dtype, shape: tuple[int, ...],
           scale_shape: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows (and scales) of a stored block, after checking it is the block `key` names, stored as `dtype` in
    `shape`; raises UntrustedBlock otherwise."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise UntrustedBlock("foreign file", "not a KV block file of this format")
    (head_len,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if start + head_len + 4 > len(data):
        raise UntrustedBlock("truncated file", f"{len(data)} bytes")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(memoryview(data)[start:-4]) != crc:
        raise UntrustedBlock("corrupt file", "its checksum does not match its contents")
    try:
        header = json.loads(bytes(data[start:start + head_len]))
    except ValueError as exc:
        raise UntrustedBlock("corrupt file", f"unreadable header ({exc})") from None
    if header.get("format") != FORMAT or header.get("fingerprint") != key.fingerprint:
        raise UntrustedBlock("foreign file", "written for another model, setting or version")
    wanted = key.header()
    if any(header.get(name) != value for name, value in wanted.items()):
        raise UntrustedBlock("other block", "its key differs from the request's (a hash collision or a renamed file)")
    scales_given = header.get("scales")
    if (header.get("dtype") != str(dtype).removeprefix("torch.") or header.get("shape") != list(shape)
            or scales_given != (None if scale_shape is None else list(scale_shape))):
        raise UntrustedBlock("foreign file", "its rows have another shape or dtype")
    payload = memoryview(data)[start + head_len:-4]
    elem = torch.empty((), dtype=dtype).element_size()
    rows_bytes = elem * math.prod(shape)
    scale_bytes = 0 if scale_shape is None else SCALE_DTYPE.itemsize * math.prod(scale_shape)
    if len(payload) != rows_bytes + scale_bytes:
        raise UntrustedBlock("truncated file", f"{len(payload)} payload bytes, {rows_bytes + scale_bytes} expected")
    raw = torch.frombuffer(payload, dtype=torch.uint8)
    rows = raw[:rows_bytes].view(dtype).reshape(shape)
    scales = None if scale_shape is None else raw[rows_bytes:].view(SCALE_DTYPE).reshape(scale_shape)
    return rows, scales

