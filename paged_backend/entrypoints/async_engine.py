"""AsyncEngine: one background thread steps the engine; any coroutine or thread streams from it.

The model forward blocks, so it runs on its own thread, never on an event loop. Callers hand
commands (add, abort, stats) to that thread through a queue and receive their request's outputs
through a per-request sink, so the engine's state is only ever touched by one thread (callers read
only what is fixed at start-up: the tokenizer and limits, and the LoRA registry, which has its own
lock). A consumer that stops iterating aborts its request, which frees its blocks at the next step.
AsyncEngine is an `EngineClient`, what the server and LangChain are written against.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any

from paged_backend import tracing
from paged_backend.core.outputs import RequestOutput, failed_output
from paged_backend.core.pooling import PoolingParams
from paged_backend.core.request import LogitsProcessor
from paged_backend.engine import Engine, Prompt
from paged_backend.image_prompts import ProcessedPrompt, is_image_prompt
from paged_backend.kernels import openmp
from paged_backend.entrypoints.engine_client import Sink
from paged_backend.model.lora import LoRAAdapter, LoRASpec
from paged_backend.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
STATS_POLL_S = 1.0  # how often a caller waiting for stats checks that the engine thread still runs


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Fixed for the engine's life, so any thread may read them.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.eos_token_ids
        self.image_prompts = engine.inputs.image_prompts()
        self.commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}
        self.wakeup = threading.Event()
        self.stopped = threading.Event()
        self.ids = itertools.count()
        # The engine thread's OpenMP team must be the only one: this thread's, kept from loading the model,
        # would make every step's parallel regions wake sleeping workers (see kernels/openmp.py).
        openmp.release_thread_team()
        self.thread = threading.Thread(target=self.run_loop, name="paged-backend-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ public API

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        logits_processor: LogitsProcessor | None = None, lora: LoRASpec | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as they change; the last one has `finished=True`."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = self.submit(prompt, params, request_id, lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o),
                                 logits_processor, lora)
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        logits_processor: LogitsProcessor | None = None, lora: LoRASpec | None = None,
    ) -> Iterator[RequestOutput]:
        """The same as `generate`, for plain threads."""
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        request_id = self.submit(prompt, params, request_id, outputs.put, logits_processor, lora)
        finished = False
        try:
            while not finished:
                output = outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, sink: Sink,
               logits_processor: LogitsProcessor | None = None, lora: LoRASpec | None = None) -> str:
        """Validate in the caller's thread (a bad request raises here), then queue it for the engine.
        `logits_processor` runs on the engine thread (see `Engine.add_request`); `lora` names an adapter."""
        params = params or SamplingParams()
        if is_image_prompt(prompt):  # its images through the processor once, here
            prompt = self.engine.inputs.read_images(prompt)
        text, token_ids = self.tokenize(prompt)
        self.engine.inputs.validate(token_ids, params, getattr(prompt, "images", ()))
        adapter = self.engine.resolve_lora(lora)
        request_id = request_id if request_id is not None else f"async-{next(self.ids)}"
        queued = prompt if isinstance(prompt, ProcessedPrompt) else text if text is not None else token_ids
        self.commands.put(("add", (request_id, queued, token_ids, params, sink, logits_processor, adapter,
                                   tracing.current_headers())))
        self.wakeup.set()
        return request_id

    async def embed(self, prompt: Prompt, pooling: PoolingParams | None = None,
                    request_id: str | None = None) -> RequestOutput:
        """The prompt's finished output with its `embedding`; cancelling the call aborts the request."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = loop.create_future()

        def settle(output: RequestOutput) -> None:
            if not done.done():
                done.set_result(output)

        request_id = self.submit_pooling(prompt, pooling, request_id, lambda o: loop.call_soon_threadsafe(settle, o))
        try:
            return await done
        finally:
            if not done.done():
                self.abort(request_id)

    def submit_pooling(self, prompt: Prompt, pooling: PoolingParams | None, request_id: str | None,
                       sink: Sink) -> str:
        """Validate in the caller's thread (a bad request raises here), then queue it for the engine."""
        pooling = pooling or PoolingParams()
        text, token_ids = self.tokenize(prompt)
        self.engine.inputs.validate_pooling(token_ids, pooling)
        request_id = request_id if request_id is not None else f"async-{next(self.ids)}"
        self.commands.put(("pool", (request_id, text if text is not None else token_ids, token_ids, pooling, sink,
                                    tracing.current_headers())))
        self.wakeup.set()
        return request_id

    def validate_pooling(self, token_ids: list[int], pooling: PoolingParams) -> None:
        self.engine.inputs.validate_pooling(token_ids, pooling)

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))
        self.wakeup.set()

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.engine.inputs.tokenize(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams, lora: LoRASpec | None = None) -> None:
        self.engine.resolve_lora(lora)
        self.engine.inputs.validate(token_ids, params)

    def stats(self) -> dict[str, Any]:
        """`Engine.stats()`, computed on the engine thread between two steps, so a metrics scrape never
        reads the scheduler or the block pool while a step changes them. Waits for at most the step in
        progress; once the engine thread has stopped, nothing else touches the engine, so it is read here."""
        if not self.thread.is_alive():
            return self.engine.stats()
        reply: Future[dict[str, Any]] = Future()
        self.commands.put(("stats", reply))
        self.wakeup.set()
        while True:
            try:
                return reply.result(timeout=STATS_POLL_S)
            except TimeoutError:
                if not self.thread.is_alive():
                    return self.engine.stats()

    @property
    def supports_lora(self) -> bool:
        return self.engine.config.enable_lora

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def add_lora(self, name: str, source: Any) -> None:
        self.engine.add_lora(name, source)  # the registry takes its own lock; slots are loaded by the engine thread

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def is_alive(self) -> bool:
        """Whether the engine thread is still stepping (what the server's /health reports)."""
        return self.thread.is_alive()

    def shutdown(self) -> None:
        self.stopped.set()
        self.wakeup.set()
        self.thread.join(timeout=10)
        self.engine.flush_offload()

    # ------------------------------------------------------------ engine thread

    def run_loop(self) -> None:
        while not self.stopped.is_set():
            self.apply_commands()
            if not self.engine.has_unfinished_requests():
                self.wakeup.wait(IDLE_WAIT_S)
                self.wakeup.clear()
                continue
            self.deliver(self.engine.step())

    def apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.add(*arg)
            elif kind == "pool":
                self.add_pooling(*arg)
            elif kind == "stats":
                self.answer_stats(arg)
            else:
                self.engine.abort_request(arg)

    def answer_stats(self, reply: Future[dict[str, Any]]) -> None:
        try:
            reply.set_result(self.engine.stats())
        except Exception as exc:  # noqa: BLE001  (the caller's error, not a reason to stop stepping)
            reply.set_exception(exc)

    def add(self, request_id: str, prompt: Prompt, token_ids: list[int], params: SamplingParams, sink: Sink,
            logits_processor: LogitsProcessor | None, adapter: LoRAAdapter | None = None,
            trace_headers: dict[str, str] | None = None) -> None:
        try:
            # The submitting thread's trace context: this thread has none of its own.
            self.engine.add_request(prompt, params, request_id=request_id, prompt_token_ids=token_ids,
                                    logits_processor=logits_processor, lora=adapter, trace_headers=trace_headers or {})
        except ValueError as exc:  # e.g. a duplicate id: the caller gets a finished output with the error
            logger.warning("request %s refused: %s", request_id, exc)
            sink(failed_output(request_id, prompt if isinstance(prompt, str) else None, token_ids, str(exc)))
            return
        self.sinks[request_id] = sink

    def add_pooling(self, request_id: str, prompt: Prompt, token_ids: list[int], pooling: PoolingParams,
                    sink: Sink, trace_headers: dict[str, str] | None = None) -> None:
        try:
            self.engine.add_pooling_request(prompt, pooling, request_id=request_id, prompt_token_ids=token_ids,
                                            trace_headers=trace_headers or {})
        except ValueError as exc:  # e.g. a duplicate id: the caller gets a finished output with the error
            logger.warning("request %s refused: %s", request_id, exc)
            sink(failed_output(request_id, prompt if isinstance(prompt, str) else None, token_ids, str(exc)))
            return
        self.sinks[request_id] = sink

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self.sinks.pop(output.request_id) if output.finished else self.sinks.get(output.request_id)
            if sink is not None:
                sink(output)

