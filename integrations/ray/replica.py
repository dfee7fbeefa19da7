"""EngineReplica: one engine (LLM + AsyncEngine) living in its own Ray actor process.

Each replica loads its own copy of the model by path, so replicas never share memory or a device.
Requests reach it as plain Ray calls: `complete` returns the final output in one reply (the batch
path), `generate` is a Ray streaming generator that yields every incremental output, at most
`STREAM_WINDOW` outputs ahead of its consumer. A request naming a LoRA adapter carries it as a
`ShippedLoRA`; the replica registers it first if it lacks it (see `replica_loras`).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle

from paged_backend.core.outputs import RequestOutput
from paged_backend.core.pooling import PoolingParams
from paged_backend.core.request import LogitsProcessor
from paged_backend.entrypoints.async_engine import AsyncEngine
from paged_backend.entrypoints.llm import LLM
from paged_backend.sampling.sampling_params import SamplingParams

from .replica_loras import ReplicaAdapters, ShippedLoRA

Prompt = str | Sequence[int]

# Streamed outputs a replica may produce ahead of its consumer. Each output carries the tokens so far, so
# an unbounded lead would park a whole generation, quadratically, in the object store of a slow client.
STREAM_WINDOW = 16


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the client needs to validate requests without a model of its own."""

    max_model_len: int
    vocab_size: int
    block_size: int
    max_num_seqs: int
    tokenizer: Any
    hostname: str
    pid: int
    device: str
    eos_token_ids: frozenset[int] = frozenset()
    context_note: str = ""  # why the context is shorter than the model's positions, when it is
    enable_lora: bool = False  # whether requests may name LoRA adapters
    hidden_size: int = 0  # an embedding's size
    embedding_sizes: tuple[int, ...] | None = None  # the sizes an embedding may be truncated to, if any


class EngineReplica:
    """Owns its engine (it builds the LLM), so it reads the engine's settings directly; requests and
    stats go through the AsyncEngine, whose thread alone steps the engine."""

    def __init__(self, model: str | None, tokenizer: str | None, engine_config: dict[str, Any]) -> None:
        self.llm = LLM(model, tokenizer, **engine_config)
        self.aengine = AsyncEngine(self.llm.engine)
        self.adapters = ReplicaAdapters(self.llm)

    def describe(self) -> ReplicaInfo:
        engine = self.llm.engine
        return ReplicaInfo(engine.max_model_len, engine.vocab_size, engine.config.block_size,
                           engine.config.max_num_seqs, engine.tokenizer, socket.gethostname(), os.getpid(),
                           str(engine.device), engine.eos_token_ids, engine.plan.context_note, engine.config.enable_lora,
                           engine.hidden_size, engine.embedding_sizes)

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=STREAM_WINDOW)
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       logits_processor: LogitsProcessor | None = None,
                       lora: ShippedLoRA | None = None) -> AsyncIterator[RequestOutput]:
        name = await self.adapters.ensure(lora)
        async for output in self.aengine.generate(prompt, params, request_id, logits_processor, name):
            yield output

    async def complete(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       logits_processor: LogitsProcessor | None = None,
                       lora: ShippedLoRA | None = None) -> RequestOutput:
        name = await self.adapters.ensure(lora)
        final = None
        async for output in self.aengine.generate(prompt, params, request_id, logits_processor, name):
            final = output
        return final

    async def embed(self, prompt: Prompt, pooling: PoolingParams, request_id: str) -> RequestOutput:
        return await self.aengine.embed(prompt, pooling, request_id)

    async def add_lora(self, lora: ShippedLoRA, source: Any) -> None:
        """Register an adapter (its source already read from the object store by Ray), off the event loop."""
        await asyncio.to_thread(self.adapters.register, lora, source)

    async def remove_lora(self, name: str, token: str) -> None:
        await asyncio.to_thread(self.adapters.remove, name, token)

    def list_loras(self) -> list[str]:
        return self.llm.list_loras()

    def abort(self, request_id: str) -> None:
        self.aengine.abort(request_id)

    async def stats(self) -> dict[str, float]:
        # AsyncEngine.stats waits for the engine thread's answer: off this actor's event loop.
        return await asyncio.to_thread(self.aengine.stats)


def launch_replicas(
    model: str | os.PathLike | None = None,
    num_replicas: int = 2,
    tokenizer: str | os.PathLike | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_restarts: int = 0,
    **engine_config: Any,
) -> list[ActorHandle]:
    """Start `num_replicas` EngineReplica actors, each loading `model` (a path, hub id or None for the
    default model) itself; extra keywords are `LLM` / EngineConfig keywords. Returns at once: the
    actors load in the background (`ray.get(r.describe.remote())` waits for one). With `max_restarts`,
    Ray restarts a replica whose process dies (reloading the model) up to that many times."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if engine_config.get("tensor_parallel_size", 1) > 1:
        raise NotImplementedError("tensor_parallel_size > 1 inside replicas: each replica would need its "
                                  "ranks placed together (a Ray placement group), which launch_replicas "
                                  "does not do yet")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError("each replica loads the model itself: pass a path or hub id, not a loaded model")
    if num_gpus == 0 and engine_config.get("num_threads") is None:
        # Ray reserves whole CPUs per actor; more torch threads than that would fight the other replicas.
        engine_config["num_threads"] = max(1, int(num_cpus))
    actor = ray.remote(EngineReplica).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts)
    path = None if model is None else os.fspath(model)
    tok = None if tokenizer is None else os.fspath(tokenizer)
    return [actor.remote(path, tok, dict(engine_config)) for _ in range(num_replicas)]
