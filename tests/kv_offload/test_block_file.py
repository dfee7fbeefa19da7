"""A stored block is used only when every check passes: model, block key, shape, dtype and checksum."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kv_offload.block_file import StoredKey, UntrustedBlock, decode, encode

SHAPE = (2, 2, 3, 4, 8)
KEY = StoredKey("f" * 32, 0, 12345, None, (5, 6, 7, 8), None)


def stored(key: StoredKey = KEY, dtype: torch.dtype = torch.bfloat16, scales: bool = False) -> bytearray:
    rows = torch.randn(SHAPE).to(dtype)
    scale = torch.rand(SHAPE[:-1]) if scales else None
    return bytearray(b"".join(bytes(piece) for piece in encode(key, rows, scale)))


def test_round_trip_gives_the_rows_and_scales_back() -> None:
    rows = torch.randn(SHAPE).to(torch.bfloat16)
    codes = torch.randint(-127, 128, SHAPE, dtype=torch.int8)
    scales = torch.rand(SHAPE[:-1])
    for tensor, scale in ((rows, None), (codes, scales)):
        data = bytearray(b"".join(bytes(p) for p in encode(KEY, tensor, scale)))
        got, got_scales = decode(data, KEY, tensor.dtype, SHAPE, None if scale is None else SHAPE[:-1])
        assert torch.equal(got, tensor)
        assert (got_scales is None) == (scale is None) and (scale is None or torch.equal(got_scales, scale))


@pytest.mark.parametrize("position", [0, 10, 200, -5])
def test_a_flipped_byte_is_refused(position: int) -> None:
    data = stored()
    data[position] ^= 0x10
    with pytest.raises(UntrustedBlock):
        decode(data, KEY, torch.bfloat16, SHAPE, None)


def test_a_truncated_file_is_refused() -> None:
    data = stored()
    with pytest.raises(UntrustedBlock, match="truncated|corrupt"):
        decode(data[:-100], KEY, torch.bfloat16, SHAPE, None)
    with pytest.raises(UntrustedBlock):
        decode(data[:9], KEY, torch.bfloat16, SHAPE, None)


@pytest.mark.parametrize("other", [
    StoredKey("e" * 32, 0, 12345, None, (5, 6, 7, 8), None),  # another model or version
    StoredKey("f" * 32, 0, 12345, None, (5, 6, 7, 9), None),  # the same hash over other tokens
    StoredKey("f" * 32, 0, 12345, 99, (5, 6, 7, 8), None),  # another parent
    StoredKey("f" * 32, 0, 12345, None, (5, 6, 7, 8), "tenant"),  # another cache salt
    StoredKey("f" * 32, 1, 12345, None, (5, 6, 7, 8), None),  # another layer group
])
def test_a_block_stored_under_another_key_is_refused(other: StoredKey) -> None:
    with pytest.raises(UntrustedBlock):
        decode(stored(), other, torch.bfloat16, SHAPE, None)


def test_rows_of_another_dtype_or_shape_are_refused() -> None:
    data = stored()
    with pytest.raises(UntrustedBlock, match="shape or dtype"):
        decode(data, KEY, torch.float16, SHAPE, None)
    with pytest.raises(UntrustedBlock, match="shape or dtype"):
        decode(data, KEY, torch.bfloat16, (2, 2, 3, 4, 4), None)
    with pytest.raises(UntrustedBlock, match="shape or dtype"):
        decode(data, KEY, torch.bfloat16, SHAPE, SHAPE[:-1])


def test_a_file_of_another_format_is_refused() -> None:
    with pytest.raises(UntrustedBlock, match="foreign"):
        decode(bytearray(b"GGUF" + bytes(100)), KEY, torch.bfloat16, SHAPE, None)
