"""Run the engine requests of one API call (one per prompt, its n choices as the request's samples)
and merge their streams into one stream per choice.

A prompt's n choices are one engine request with `n` samples (seeds seed + i), so they share the
prompt's KV blocks. Each request runs in its own task; cancelling the merged stream (the client went
away) cancels every task, and each task's client `generate` aborts its request, which frees its
KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from paged_backend.core.outputs import RequestOutput
from paged_backend.core.request import LogitsProcessor
from paged_backend.image_prompts import ProcessedPrompt
from paged_backend.entrypoints.engine_client import EngineClient
from paged_backend.sampling.sampling_params import SamplingParams

from .errors import APIError
from .metrics import ServerMetrics

DISCONNECT_POLL_S = 0.2
T = TypeVar("T")


@dataclass(slots=True)
class Job:
    """One engine request: the index of its first choice, its prompt token ids and its parameters;
    it fills choices `index .. index + params.n - 1`."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    processor: LogitsProcessor | None = None  # the request's logits processor (logit_bias)
    lora: str | None = None  # the LoRA adapter the request's `model` names (None: the base model)
    images: ProcessedPrompt | None = None  # a conversation with images: its processed prompt (run instead of the ids)

    @property
    def choices(self) -> range:
        return range(self.index, self.index + self.params.n)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def merge_streams(client: EngineClient, jobs: Sequence[Job], request_id: str,
                        metrics: ServerMetrics) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) as any job's output changes, until every job has finished."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
    tasks = [asyncio.create_task(pump(client, job, f"{request_id}-{job.index}", queue)) for job in jobs]
    unfinished = {choice for job in jobs for choice in job.choices}
    last_output_at: dict[int, float] = {}
    try:
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            metrics.record_tokens(last_output_at, index, item)
            if item.finished:
                unfinished.discard(index)
                metrics.record_finished(item)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        metrics.record_aborted(len(unfinished))


async def pump(client: EngineClient, job: Job, request_id: str,
               queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]]) -> None:
    reported: set[int] = set()  # samples whose finished output has been passed on
    try:
        prompt = job.images if job.images is not None else job.prompt_ids
        async for output in client.generate(prompt, job.params, request_id=request_id,
                                             logits_processor=job.processor, lora=job.lora):
            for sample, choice_output in split_samples(output, job.params.n, reported):
                queue.put_nowait((job.index + sample, choice_output))
    except ValueError as exc:  # validated before, so only a race (e.g. a reused id) lands here
        queue.put_nowait((job.index, APIError(400, str(exc))))
    except Exception as exc:  # noqa: BLE001  (anything else must reach the caller, or its stream would wait forever)
        queue.put_nowait((job.index, APIError(500, f"generation failed: {type(exc).__name__}: {exc}")))


def split_samples(output: RequestOutput, n: int, reported: set[int]) -> list[tuple[int, RequestOutput]]:
    """(sample index, an output that looks like an n = 1 request's) for each sample the output touches.

    With n > 1 the engine streams one sample per output, that sample's delta included, and ends with an
    output holding every sample and no delta: that one only finishes the samples not yet reported
    finished (all of them when the request was aborted)."""
    if n == 1:
        return [(0, output)]
    if output.finished:
        last = [s for s in output.outputs if s.index not in reported]
        reported.update(s.index for s in last)
        return [(s.index, dataclasses.replace(output, outputs=[s])) for s in last]
    sample = output.outputs[0]
    done = sample.finish_reason is not None
    if done:
        reported.add(sample.index)
    return [(sample.index, dataclasses.replace(output, finished=done))]


async def collect_finals(http_request: Request, client: EngineClient, jobs: Sequence[Job], request_id: str,
                         metrics: ServerMetrics) -> dict[int, RequestOutput]:
    """The final output of every job; if the client disconnects first, abort them all and give up."""
    finals = await until_disconnect(http_request, gather_finals(client, jobs, request_id, metrics))
    failed = [out.error for out in finals.values() if out.error]
    if failed:
        raise APIError(500, f"generation failed: {failed[0]}")
    return finals


async def until_disconnect(http_request: Request, work: Awaitable[T]) -> T:
    """The result of `work`; if the client disconnects first, cancel it (cancelling the engine requests
    under it aborts them) and answer 499, the usual "client closed request"."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(http_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let the cancellation land before the task is read
    if task.cancelled():
        raise APIError(499, "the client disconnected before the answer was complete")
    return task.result()


async def gather_finals(client: EngineClient, jobs: Sequence[Job], request_id: str,
                        metrics: ServerMetrics) -> dict[int, RequestOutput]:
    finals = {}
    async for index, output in merge_streams(client, jobs, request_id, metrics):
        if output.finished:
            finals[index] = output
    return finals


async def wait_for_disconnect(http_request: Request) -> None:
    while not await http_request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
