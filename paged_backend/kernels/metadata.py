"""The per-step description of a flattened ragged batch that every attention backend reads.

One engine step packs the new tokens of all scheduled sequences into one row `[T]`. Sequence `i`
owns query rows `query_start_loc[i]:query_start_loc[i + 1]`; its keys are the first `seq_lens[i]`
slots reached through `block_tables[i]`, and its queries are the last of those positions. So a
query at local index `j` of a sequence with `n` new tokens sees key positions
`<= seq_lens[i] - n + j`: one rule covers prefill, chunked prefill, prefix hits and decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (negative: do not write)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context + new tokens per sequence
    block_size: int
    # Host copies, so backends that loop over sequences never sync with the device to read them.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    # Backends memoise what they derive once per step (gather indices, masks) here, so the work is
    # shared by every layer of the forward instead of being redone per layer.
    derived: dict[str, Any] = field(default_factory=dict)
    # Split-KV segments of a pure decode step, fixed by the caller: a captured CUDA graph replays one
    # launch grid, so it cannot follow the step's max_seq_len. None: the backend chooses per step.
    num_kv_segments: int | None = None
    # Sequences with images whose tokens attend both ways (Gemma 3), by index: each image's (first, last + 1)
    # positions as offsets from the sequence's end; its queries see every key of the image (the PyTorch backend's
    # attend_one). None: causal everywhere.
    widened: dict[int, tuple[tuple[int, int], ...]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def host_block_tables(metadata: AttentionMetadata) -> np.ndarray:
    """`metadata.block_tables` as a host numpy array, copied from the device at most once per step."""
    host = metadata.derived.get("host_block_tables")
    if host is None:
        tables = metadata.block_tables
        host = metadata.derived["host_block_tables"] = (tables if tables.device.type == "cpu" else tables.cpu()).numpy()
    return host


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`: on CPU the tensor shares the array's memory; a copy to a GPU does not wait."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def pack_sequences(block_tables: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_size: int,
                   device: torch.device) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
    """Positions, query offsets and the attention metadata of a packed row where sequence i (block table row i)
    computes `counts[i]` tokens from position `starts[i]`: how the model runner, the start-up self-check and
    the compile warm-up all describe a step."""
    ends = starts + counts
    query_start_loc = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    positions = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1] - starts, counts)
    rows = np.repeat(np.arange(len(starts)), counts)
    slots = block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=to_device(slots, device),
        block_tables=to_device(block_tables.astype(np.int32, copy=False), device),
        query_start_loc=to_device(query_start_loc.astype(np.int32), device),
        seq_lens=to_device(ends.astype(np.int32), device),
        block_size=block_size,
        query_start_loc_host=query_start_loc.tolist(),
        seq_lens_host=ends.tolist(),
        max_query_len=int(counts.max()),
        max_seq_len=int(ends.max()),
    )
    return positions, query_start_loc, metadata
