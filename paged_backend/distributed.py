"""Tensor parallelism: one engine over N processes with torch.distributed (NCCL on GPUs, gloo on CPU).

transformers' own tensor-parallel plan (`tp_plan="auto"`) shards the weights while loading, so the
attention of each rank sees only its own heads and its PagedCache holds only their K/V (the shape
probe finds the local head count by itself). Rank 0 runs the scheduler and the sampler and faces the
user; before every forward it broadcasts the step's packed inputs, and the other ranks run the same
forward on them. The plan gathers the logits, so only rank 0 reads them.

Launch with `torchrun --nproc-per-node N script.py` (every rank runs the script; `LLM(...)` returns
on rank 0 only, the others serve as workers and exit when rank 0 closes), or from a plain process,
where `LLM(..., tensor_parallel_size=N)` spawns the N - 1 workers itself.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.kernels import AttentionMetadata

from .model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)

HEADER = 6  # T, num_seqs, block-table width, logits rows, max query len, max seq len


class TensorParallelGroup:
    """This process's place in the group, and the workers it spawned (rank 0 of a spawned group)."""

    def __init__(self, size: int, rank: int, workers: list[Any], launched_by_torchrun: bool) -> None:
        self.size = size
        self.rank = rank
        self.workers = workers
        self.launched_by_torchrun = launched_by_torchrun
        self.closed = False

    @classmethod
    def join(cls, size: int, spawn_args: tuple) -> TensorParallelGroup:
        """Join the group torchrun (or our parent) set up in the environment, or spawn one."""
        if dist.is_initialized():
            check_size(size)
            return cls(size, dist.get_rank(), [], launched_by_torchrun=True)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            init_group()
            check_size(size)
            spawned = os.environ.get("PAGED_BACKEND_SPAWNED") == "1"
            return cls(size, dist.get_rank(), [], launched_by_torchrun=not spawned)
        return cls.spawn(size, spawn_args)

    @classmethod
    def spawn(cls, size: int, spawn_args: tuple) -> TensorParallelGroup:
        port = free_port()
        context = mp.get_context("spawn")
        workers = [context.Process(target=run_spawned_worker, args=(rank, size, port, *spawn_args), daemon=True)
                   for rank in range(1, size)]
        for worker in workers:
            worker.start()
        set_group_env(0, size, port)
        init_group()
        group = cls(size, 0, workers, launched_by_torchrun=False)
        atexit.register(group.close)
        return group

    def close(self) -> None:
        """Rank 0: tell the workers to stop, wait for spawned ones, leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0:
            send_stop()
        leave_together()
        for worker in self.workers:
            worker.join(timeout=30)
        if dist.is_initialized():
            dist.destroy_process_group()


def leave_together(timeout_s: float = 30.0) -> None:
    """Meet the other ranks before tearing the group down: a gloo rank that destroys its group while a
    peer still flushes the last broadcast can abort at exit. Bounded, so a dead peer cannot hang us."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        logger.warning("tensor-parallel ranks did not all reach shutdown: %s", exc)


def check_size(size: int) -> None:
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} but the process group has {dist.get_world_size()} ranks")


def init_group() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)


def set_group_env(rank: int, size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned_worker(rank: int, size: int, port: int, model: Any, tokenizer: Any, kwargs: dict) -> None:
    """Entry point of a spawned worker: build the same LLM, which serves rank 0 until it closes."""
    set_group_env(rank, size, port)
    os.environ["PAGED_BACKEND_SPAWNED"] = "1"
    from .llm import LLM

    LLM(model, tokenizer, tensor_parallel_size=size, **kwargs)


# ---------------------------------------------------------------- the step protocol


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
