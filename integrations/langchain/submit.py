"""Submitting requests to the shared AsyncEngine and waiting for their outputs, with a deadline.

AsyncEngine.generate/stream wait without a timeout, and a batch must be queued whole before
any of it is awaited, so the adapters queue through `AsyncEngine.submit` with their own sinks.
Leaving early (an exception, a closed generator, the deadline) aborts the request, which frees
its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Iterator, Sequence

from paged_backend import AsyncEngine, RequestOutput, SamplingParams
from paged_backend.engine import Prompt
from paged_backend.model.lora import LoRASpec


def stream_outputs(aengine: AsyncEngine, prompt: Prompt, params: SamplingParams,
                   timeout: float | None, lora: LoRASpec | None = None) -> Iterator[RequestOutput]:
    """Yield one request's outputs as they change (blocking); the last has finished=True."""
    for _, output in run_batch(aengine, [prompt], params, timeout, lora):
        yield output


def run_batch(aengine: AsyncEngine, prompts: Sequence[Prompt], params: SamplingParams,
              timeout: float | None, lora: LoRASpec | None = None) -> Iterator[tuple[int, RequestOutput]]:
    """Queue every prompt before waiting on any; yield (prompt index, output) as outputs arrive."""
    validate_all(aengine, prompts, params, lora)
    outputs: queue.SimpleQueue[tuple[int, RequestOutput]] = queue.SimpleQueue()
    ids = [aengine.submit(p, params, None, lambda o, i=i: outputs.put((i, o)), **lora_option(lora))
           for i, p in enumerate(prompts)]
    deadline = make_deadline(timeout)
    pending = set(range(len(ids)))
    try:
        while pending:
            index, output = get_before(outputs, deadline, timeout)
            raise_if_failed(output)
            if output.finished:
                pending.discard(index)
            yield index, output
    finally:
        for index in pending:
            aengine.abort(ids[index])


async def astream_outputs(aengine: AsyncEngine, prompt: Prompt, params: SamplingParams,
                          timeout: float | None, lora: LoRASpec | None = None) -> AsyncIterator[RequestOutput]:
    """The same as `stream_outputs`, awaiting on the caller's event loop."""
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
    request_id = aengine.submit(prompt, params, None, lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o),
                                **lora_option(lora))
    deadline = make_deadline(timeout)
    finished = False
    try:
        while not finished:
            try:
                output = await asyncio.wait_for(outputs.get(), remaining(deadline))
            except asyncio.TimeoutError:
                raise TimeoutError(f"the request took longer than timeout={timeout} s") from None
            raise_if_failed(output)
            finished = output.finished
            yield output
    finally:
        if not finished:
            aengine.abort(request_id)


def validate_all(aengine: AsyncEngine, prompts: Sequence[Prompt], params: SamplingParams,
                 lora: LoRASpec | None = None) -> None:
    """Check the whole batch first, so a bad prompt (or an unknown adapter) never leaves half a batch running."""
    if lora is not None:
        aengine.engine.resolve_lora(lora)
    for i, prompt in enumerate(prompts):
        try:
            aengine.engine.validate(aengine.engine.tokenize(prompt)[1], params)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None


def lora_option(lora: LoRASpec | None) -> dict:
    """Only a call with an adapter passes one, so engine fronts without LoRA (Ray replicas) keep working."""
    return {} if lora is None else {"lora": lora}


def get_before(outputs: queue.SimpleQueue, deadline: float | None, timeout: float | None):
    try:
        return outputs.get(timeout=remaining(deadline))
    except queue.Empty:
        raise TimeoutError(f"the request took longer than timeout={timeout} s") from None


def make_deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def raise_if_failed(output: RequestOutput) -> None:
    if output.error is not None:
        raise RuntimeError(f"request {output.request_id} failed in the engine: {output.error}")
