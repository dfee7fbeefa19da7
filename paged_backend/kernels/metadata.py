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
