"""Tensor parallelism, the launch: one engine over N processes with torch.distributed (NCCL on GPUs,
gloo on CPU).

transformers' own tensor-parallel plan (`tp_plan="auto"`) shards the weights while loading, so the
attention of each rank sees only its own heads and its PagedCache holds only their K/V (the shape
probe finds the local head count by itself). Rank 0 runs the scheduler and the sampler and faces the
user; the other ranks run the same forwards on the inputs rank 0 broadcasts (`step_protocol`).

Launch with `torchrun --nproc-per-node N script.py` (every rank runs the script; `LLM(...)` returns
on rank 0 only, the others serve as workers and exit when rank 0 closes), or from a plain process,
where `LLM(..., tensor_parallel_size=N)` spawns the N - 1 workers itself. This module sits above the
engine: what a spawned worker runs is handed to it by the caller (`LLM`), never imported from here.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.parallel.step_protocol import send_stop

logger = logging.getLogger(__name__)


class TensorParallelGroup:
    """This process's place in the group, and the workers it spawned (rank 0 of a spawned group)."""

    def __init__(self, size: int, rank: int, workers: list[Any], launched_by_torchrun: bool) -> None:
        self.size = size
        self.rank = rank
        self.workers = workers
        self.launched_by_torchrun = launched_by_torchrun
        self.closed = False
        self.saved_env: dict[str, str | None] | None = None  # rank 0 of a spawned group: the environment before

    @classmethod
    def join(cls, size: int, worker_main: Callable[..., None], spawn_args: tuple) -> TensorParallelGroup:
        """Join the group torchrun (or our parent) set up in the environment, or spawn one."""
        if dist.is_initialized():
            check_size(size)
            return cls(size, dist.get_rank(), [], launched_by_torchrun=True)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            init_group()
            check_size(size)
            spawned = os.environ.get("PAGED_BACKEND_SPAWNED") == "1"
            return cls(size, dist.get_rank(), [], launched_by_torchrun=not spawned)
        return cls.spawn(size, worker_main, spawn_args)

    @classmethod
    def spawn(cls, size: int, worker_main: Callable[..., None], spawn_args: tuple) -> TensorParallelGroup:
        """Start ranks 1..size-1 as processes running `worker_main(*spawn_args)` once their group
        environment is set, and join the group as rank 0."""
        port = free_port()
        context = mp.get_context("spawn")
        workers = [context.Process(target=run_spawned_worker, args=(rank, size, port, worker_main, spawn_args),
                                   daemon=True)
                   for rank in range(1, size)]
        for worker in workers:
            worker.start()
        saved_env = {name: os.environ.get(name) for name in GROUP_ENV}
        set_group_env(0, size, port)
        init_group()
        group = cls(size, 0, workers, launched_by_torchrun=False)
        group.saved_env = saved_env
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
        if self.saved_env is not None:  # else a later group in this process would take it for torchrun's
            restore_env(self.saved_env)


    def abandon(self) -> None:
        """Rank 0, when building its engine failed after the group formed: the workers cannot be told
        to stop (they may be building theirs, or have failed too), so spawned ones are terminated; the
        group is left so this process can form another, and the environment is restored."""
        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            if worker.is_alive():
                worker.terminate()
            worker.join(timeout=30)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.saved_env is not None:
            restore_env(self.saved_env)


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


GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def set_group_env(rank: int, size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned_worker(rank: int, size: int, port: int, worker_main: Callable[..., None], args: tuple) -> None:
    """Entry point of a spawned worker: take its place in the group, then run what the caller gave."""
    set_group_env(rank, size, port)
    os.environ["PAGED_BACKEND_SPAWNED"] = "1"
    worker_main(*args)
