"""Decode-only steps padded to a few fixed batch sizes, over input buffers allocated once.

A CUDA graph replays the kernels it recorded on the memory it recorded them with (cuda_graphs.py).
So a decode-only step (one new token per sequence) of `n` sequences is padded to the smallest
configured size >= n, and its inputs are copied into persistent buffers: ids, positions, slot
mapping, block tables, sequence lengths, query offsets and kept logits rows. Every size then has one
shape, one set of addresses and one launch grid, whatever the step.

Padding rows are one-token sequences at position 0. Their K/V go to a scratch slot (a block held
back from the block pool, which no request ever owns), they attend to that slot alone, and their
logits rows are computed but never returned, so nothing of theirs reaches a request.

The same path runs on CPU (`EngineConfig(pad_decode=True)`), where nothing is captured: it is how
the padding itself is tested without a GPU.
"""

from __future__ import annotations

import bisect

import torch

from paged_backend.kernels import AttentionMetadata
from paged_backend.model.step_inputs import StepInputs


class DecodePadding:
    def __init__(self, sizes: list[int], max_blocks_per_seq: int, scratch_block: int, block_size: int,
                 device: torch.device, kv_segments: dict[int, int] | None = None) -> None:
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.kv_segments = kv_segments or {}  # size -> split-KV segments fixed for its graph (CUDA)
        self.num_padded_steps = 0
        rows = self.sizes[-1]
        # Inference tensors, as every step's own inputs are (steps run under inference_mode): a compiled
        # forward guards on that, and would compile again for normal ones.
        with torch.inference_mode():
            self.allocate(rows, max_blocks_per_seq, device)

    def allocate(self, rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((rows, max_blocks_per_seq), self.scratch_block, dtype=torch.int32,
                                       device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        # One token per sequence: the query offsets of every decode step are 0, 1, 2, ... (never rewritten).
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.long, device=device)
        self.row_numbers = torch.arange(rows, dtype=torch.long, device=device)

    def size_for(self, inputs: StepInputs) -> int | None:
        """The padded size of this step, or None when it is not decode-only or is larger than every size."""
        metadata = inputs.metadata
        if metadata.max_query_len != 1 or metadata.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        index = bisect.bisect_left(self.sizes, metadata.num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def pad(self, inputs: StepInputs, size: int) -> StepInputs:
        """The step copied into the buffers' first `size` rows, padded; its logits rows come first."""
        metadata = inputs.metadata
        n, width, kept = metadata.num_seqs, metadata.block_tables.shape[1], inputs.logits_indices.shape[0]
        self.input_ids[:n].copy_(inputs.input_ids[0], non_blocking=True)
        self.positions[:n].copy_(inputs.position_ids[0], non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.logits_indices[:kept].copy_(inputs.logits_indices, non_blocking=True)
        self.fill_padding(n, size)
        self.logits_indices[kept:size].copy_(self.row_numbers[kept:size])  # any row: computed, never returned
        self.num_padded_steps += 1
        padded = self.metadata(size, metadata.seq_lens_host + [1] * (size - n), metadata.max_seq_len)
        # [None] of a 1-D slice: contiguous `[1, size]`, as an unpadded step's inputs are (a compiled forward
        # guards on strides).
        return inputs._replace(input_ids=self.input_ids[:size][None], position_ids=self.positions[:size][None],
                               logits_indices=self.logits_indices[:size], metadata=padded, real_rows=kept)

    def fill_padding(self, first: int, size: int) -> None:
        """Rows `first..size-1` become one-token sequences at position 0 over the scratch slot."""
        if first == size:
            return
        self.input_ids[first:size] = 0
        self.positions[first:size] = 0
        self.slot_mapping[first:size] = self.scratch_slot
        self.block_tables[first:size, 0] = self.scratch_block
        self.seq_lens[first:size] = 1

    def metadata(self, size: int, seq_lens_host: list[int], max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_size=self.block_size,
            query_start_loc_host=list(range(size + 1)),
            seq_lens_host=seq_lens_host,
            max_query_len=1,
            max_seq_len=max_seq_len,
            num_kv_segments=self.kv_segments.get(size),
        )

    def padding_only(self, size: int) -> StepInputs:
        """A step of `size` padding rows, in the buffers: what a graph is captured on."""
        self.fill_padding(0, size)
        self.logits_indices[:size].copy_(self.row_numbers[:size])
        return StepInputs(self.input_ids[:size][None], self.positions[:size][None], self.logits_indices[:size], [],
                          self.metadata(size, [1] * size, 1), real_rows=0)

