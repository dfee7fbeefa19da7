"""Tensor parallelism, the per-step protocol below the engine: rank 0 broadcasts each step's packed
inputs before its forward and the other ranks run the same forward on them (two collectives per
step); a header of -1 tells them to stop. The plan gathers the logits, so only rank 0 reads them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paged_backend.kernels import AttentionMetadata
from paged_backend.model.model_runner import ModelRunner
from paged_backend.model.step_inputs import StepInputs

HEADER = 6  # T, num_seqs, block-table width, logits rows, max query len, max seq len

def broadcast_step(inputs: StepInputs) -> None:
    """Rank 0: send this step's packed inputs to every other rank (two collectives)."""
    md = inputs.metadata
    header = [inputs.input_ids.shape[1], md.num_seqs, md.block_tables.shape[1], inputs.logits_indices.numel(),
              md.max_query_len, md.max_seq_len]
    device = inputs.input_ids.device
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), src=0)
    parts = [inputs.input_ids, inputs.position_ids, inputs.logits_indices, md.slot_mapping, md.block_tables,
             md.query_start_loc, md.seq_lens]
    dist.broadcast(torch.cat([p.flatten().to(torch.int64) for p in parts]), src=0)


def send_stop() -> None:
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dist.broadcast(torch.full((HEADER,), -1, dtype=torch.int64, device=device), src=0)


def receive_step(block_size: int, device: torch.device) -> StepInputs | None:
    """Other ranks: the next step's inputs from rank 0, or None when rank 0 stops."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    tokens, seqs, width, rows, max_query, max_seq = header.tolist()
    if tokens < 0:
        return None
    sizes = [tokens, tokens, rows, tokens, seqs * width, seqs + 1, seqs]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    ids, pos, logits_rows, slots, tables, starts, lens = payload.split(sizes)
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.view(seqs, width).to(torch.int32),
        query_start_loc=starts.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        block_size=block_size,
        query_start_loc_host=starts.tolist(),
        seq_lens_host=lens.tolist(),
        max_query_len=max_query,
        max_seq_len=max_seq,
    )
    return StepInputs(ids[None], pos[None], logits_rows, [], metadata)


def serve_steps(runner: ModelRunner) -> None:
    """A worker's loop: run every step rank 0 broadcasts, until it says stop."""
    while (inputs := receive_step(runner.cache.block_size, runner.device)) is not None:
        with torch.inference_mode():
            runner.forward(inputs)


def agree_on_blocks(num_blocks: int, device: torch.device) -> int:
    """Every rank must have the same number of blocks: take the smallest any rank can afford."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return num_blocks
    value = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
