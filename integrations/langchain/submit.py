"""Submitting requests to the shared engine client and waiting for their outputs, with a deadline.

A client's generate/stream wait without a timeout, and a batch must be queued whole before
any of it is awaited, so the adapters queue through `EngineClient.submit` with their own sinks.
Leaving early (an exception, a closed generator, the deadline) aborts the request, which frees
its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Iterator, Sequence

from paged_backend.core.outputs import RequestOutput
from paged_backend.core.request import LogitsProcessor
from paged_backend.entrypoints.engine_client import EngineClient, Prompt
from paged_backend.model.lora import LoRASpec
from paged_backend.sampling.sampling_params import SamplingParams


def stream_outputs(client: EngineClient, prompt: Prompt, params: SamplingParams,
                   timeout: float | None, lora: LoRASpec | None = None,
                   logits_processor: LogitsProcessor | None = None) -> Iterator[RequestOutput]:
    """Yield one request's outputs as they change (blocking); the last has finished=True."""
    for _, output in run_batch(client, [prompt], params, timeout, lora, logits_processor):
        yield output


def run_batch(client: EngineClient, prompts: Sequence[Prompt], params: SamplingParams,
              timeout: float | None, lora: LoRASpec | None = None,
              logits_processor: LogitsProcessor | None = None) -> Iterator[tuple[int, RequestOutput]]:
    """Queue every prompt before waiting on any; yield (prompt index, output) as outputs arrive."""
    validate_all(client, prompts, params, lora)
    outputs: queue.SimpleQueue[tuple[int, RequestOutput]] = queue.SimpleQueue()
    ids = [client.submit(p, params, None, lambda o, i=i: outputs.put((i, o)), logits_processor, lora=lora)
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
            client.abort(ids[index])


async def astream_outputs(client: EngineClient, prompt: Prompt, params: SamplingParams,
                          timeout: float | None, lora: LoRASpec | None = None,
                          logits_processor: LogitsProcessor | None = None) -> AsyncIterator[RequestOutput]:
    """The same as `stream_outputs`, awaiting on the caller's event loop."""
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
    request_id = client.submit(prompt, params, None, lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o),
                                logits_processor, lora=lora)
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
            client.abort(request_id)


def validate_all(client: EngineClient, prompts: Sequence[Prompt], params: SamplingParams,
                 lora: LoRASpec | None = None) -> None:
    """Check the whole batch first, so a bad prompt (or an unknown adapter) never leaves half a batch running."""
    for i, prompt in enumerate(prompts):
        try:
            client.validate(client.tokenize(prompt)[1], params, lora)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None


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
