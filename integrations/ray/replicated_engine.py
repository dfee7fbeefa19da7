"""ReplicatedAsyncEngine: AsyncEngine's API over K engine replicas, each a Ray actor.

Every request is tokenized and validated here, routed by the Router, and run on one replica. If that
replica dies before the caller has seen any output, the request is run again on another live
replica (the whole request: nothing of it was delivered, so nothing is repeated); replicas launched
with `max_restarts` come back (Ray restarts them) and may take the retry themselves. If it dies after
outputs were streamed, the request ends with a finished output whose `error` says so: replaying it
elsewhere could change what was already shown. A request that gets no answer within
`request_timeout_s` is aborted on its replica and ends the same way. Ray reports a dead actor to
every pending call at once, so no request waits on a dead replica.

It is an `EngineClient`, so the OpenAI server runs on it as on one AsyncEngine. With replicas built
with `enable_lora=True`, LoRA adapters are served as on one engine: `add_lora` registers an adapter on
every replica, a request names one with `lora=` and is routed like any other (see `replica_loras`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from paged_backend.core.outputs import RequestOutput, failed_output
from paged_backend.core.pooling import PoolingParams
from paged_backend.core.request import LogitsProcessor
from paged_backend.entrypoints.engine_client import Sink
from paged_backend.model.lora import LoRASpec
from paged_backend.sampling.sampling_params import SamplingParams

from .background_loop import BackgroundLoop
from .errors import NoLiveReplicaError, first_line
from .prefix_table import PrefixTable
from .replica import Prompt, launch_replicas
from .replica_front import ReplicaFront
from .replica_loras import ReplicaLoRAs, ShippedLoRA
from .router import Router

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0
RESTART_WAIT_S = 300.0  # how long a retry waits for a restarting replica when requests have no timeout
RESTART_POLL_S = 0.2


class ReplicatedAsyncEngine:
    """`generate` (async) and `stream` (threads) as on AsyncEngine, over `replicas` (EngineReplica
    actors, e.g. from `launch_replicas`, all serving the same model)."""

    def __init__(self, replicas: Sequence[ActorHandle], prefix_aware: bool = False, balance_slack: int = 8,
                 request_timeout_s: float | None = DEFAULT_TIMEOUT_S, max_attempts: int = 2,
                 startup_timeout_s: float = DEFAULT_TIMEOUT_S, owns_replicas: bool = False,
                 restartable: bool = False) -> None:
        if not replicas:
            raise ValueError("a replicated engine needs at least one replica")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.replicas = list(replicas)
        self.infos = ray.get([r.describe.remote() for r in self.replicas], timeout=startup_timeout_s)
        prefixes = PrefixTable(self.infos[0].block_size) if prefix_aware else None
        self.router = Router(len(self.replicas), prefixes, balance_slack)
        self.front = ReplicaFront(self.infos, self.replicas, self.router)
        self.loras = ReplicaLoRAs(self.replicas, self.router, all(info.enable_lora for info in self.infos),
                                  request_timeout_s or DEFAULT_TIMEOUT_S)
        self.tokenizer = self.front.tokenizer
        self.max_model_len = self.front.max_model_len
        self.vocab_size = self.front.vocab_size
        self.eos_token_ids = self.front.eos_token_ids
        self.image_prompts = None  # replicas take no images yet: their prompts travel as token ids
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.owns_replicas = owns_replicas
        # Replicas Ray restarts are never written off: a retry may go to any of them, the failed one too.
        self.restartable = restartable
        self.inflight: dict[str, int] = {}  # request id -> the replica running it
        self.num_retries = 0
        self.ids = itertools.count()
        self.id_prefix = uuid.uuid4().hex[:8]  # several clients may share replicas: keep ids apart
        self.background: BackgroundLoop | None = None
        self.submitted: dict[str, Future[None]] = {}  # request id -> the task feeding its sink (submit)

    @classmethod
    def launch(cls, model: str | None = None, num_replicas: int = 2, *, tokenizer: str | None = None,
               num_cpus: float = 1, num_gpus: float = 0, prefix_aware: bool = False, balance_slack: int = 8,
               request_timeout_s: float | None = DEFAULT_TIMEOUT_S, max_attempts: int = 2, max_restarts: int = 0,
               **engine_config: Any) -> ReplicatedAsyncEngine:
        """Start `num_replicas` replicas of `model` (see `launch_replicas`) and a client owning them."""
        replicas = launch_replicas(model, num_replicas, tokenizer, num_cpus, num_gpus, max_restarts, **engine_config)
        try:
            return cls(replicas, prefix_aware, balance_slack, request_timeout_s, max_attempts, owns_replicas=True,
                       restartable=max_restarts > 0)
        except BaseException:
            kill_all(replicas)
            raise

    @property
    def engine(self) -> ReplicaFront:
        """The replicas' front, under the name code written against `AsyncEngine.engine` reads."""
        return self.front

    # ------------------------------------------------------------ public API

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       logits_processor: LogitsProcessor | None = None,
                       lora: LoRASpec | None = None) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as they change; the last one has `finished=True`. A
        `logits_processor` travels to the replica (Ray pickles it), as on AsyncEngine."""
        params, text, token_ids, request_id, shipped = self.prepare(prompt, params, request_id, lora)
        run = self.attempts(prompt, text, token_ids, params, request_id, True, logits_processor, shipped)
        async with contextlib.aclosing(run) as outs:
            async for output in outs:
                yield output

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       logits_processor: LogitsProcessor | None = None,
                       lora: LoRASpec | None = None) -> RequestOutput:
        """The final output only, in one reply from the replica (cheaper than streaming every token)."""
        params, text, token_ids, request_id, shipped = self.prepare(prompt, params, request_id, lora)
        final = None
        async for output in self.attempts(prompt, text, token_ids, params, request_id, False, logits_processor,
                                          shipped):
            final = output
        return final

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               logits_processor: LogitsProcessor | None = None,
               lora: LoRASpec | None = None) -> Iterator[RequestOutput]:
        """The same as `generate`, for plain threads."""
        return self.loop().iterate(self.generate(prompt, params, request_id, logits_processor, lora))

    def submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, sink: Sink,
               logits_processor: LogitsProcessor | None = None, lora: LoRASpec | None = None) -> str:
        """Validate here (ValueError), then run the request on the client's thread, handing every output
        to `sink` until a finished one; `abort` stops it."""
        params, text, token_ids, request_id, shipped = self.prepare(prompt, params, request_id, lora)

        async def feed() -> None:
            run = self.attempts(prompt, text, token_ids, params, request_id, True, logits_processor, shipped)
            last = None
            try:
                async with contextlib.aclosing(run) as outputs:
                    async for last in outputs:
                        sink(last)
            except asyncio.CancelledError:  # `abort`: end the stream as one engine's abort does
                if last is None or not last.finished:
                    sink(failed_output(request_id, text, token_ids, None, last))
                raise
            except Exception as exc:  # noqa: BLE001  (the sink must still get a finished output)
                sink(failed_output(request_id, text, token_ids, f"{type(exc).__name__}: {exc}", last))

        task = asyncio.run_coroutine_threadsafe(feed(), self.loop().loop)
        self.submitted[request_id] = task
        task.add_done_callback(lambda _: self.submitted.pop(request_id, None))
        return request_id

    async def run_batch(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams],
                        on_finished: Callable[[], None] | None = None,
                        loras: Sequence[LoRASpec | None] | None = None) -> list[RequestOutput]:
        """Every prompt's final output, in input order (`loras`: each prompt's adapter). Only about two
        engine batches per replica are in flight at once, so a request's timeout starts when a replica
        can soon take it."""
        window = asyncio.Semaphore(sum(2 * info.max_num_seqs for info in self.infos))
        loras = loras or [None] * len(prompts)

        async def run_one(prompt: Prompt, p: SamplingParams, lora: LoRASpec | None) -> RequestOutput:
            async with window:
                output = await self.complete(prompt, p, lora=lora)
            if on_finished is not None:
                on_finished()
            return output

        return list(await asyncio.gather(*(run_one(*job) for job in zip(prompts, params, loras))))

    async def embed(self, prompt: Prompt, pooling: PoolingParams | None = None,
                    request_id: str | None = None) -> RequestOutput:
        """The prompt's embedding from one replica (not retried elsewhere: pooling is cheap to ask again)."""
        pooling = pooling or PoolingParams()
        text, token_ids = self.tokenize(prompt)
        self.front.validate_pooling(token_ids, pooling)
        request_id = request_id if request_id is not None else f"{self.id_prefix}-{next(self.ids)}"
        try:
            index = await self.choose(token_ids, [], None)
        except NoLiveReplicaError as exc:
            return failed_output(request_id, text, token_ids, str(exc))
        self.inflight[request_id] = index
        finished = False
        try:
            output = await self.replicas[index].embed.remote(prompt, pooling, request_id)
            finished = True
            return output
        except (RayActorError, RayTaskError) as exc:
            finished = True
            return failed_output(request_id, text, token_ids, f"replica {index} failed: {first_line(exc)}")
        finally:
            if not finished:  # cancelled: free its blocks on the replica
                self.replicas[index].abort.remote(request_id)
            self.router.release(index)
            self.inflight.pop(request_id, None)

    def submit_pooling(self, prompt: Prompt, pooling: PoolingParams | None, request_id: str | None,
                       sink: Sink) -> str:
        """Validate here (ValueError), then embed on the client's thread; `abort` stops it."""
        pooling = pooling or PoolingParams()
        text, token_ids = self.tokenize(prompt)
        self.front.validate_pooling(token_ids, pooling)
        request_id = request_id if request_id is not None else f"{self.id_prefix}-{next(self.ids)}"

        async def feed() -> None:
            try:
                sink(await self.embed(prompt, pooling, request_id))
            except asyncio.CancelledError:
                sink(failed_output(request_id, text, token_ids, None))
                raise

        task = asyncio.run_coroutine_threadsafe(feed(), self.loop().loop)
        self.submitted[request_id] = task
        task.add_done_callback(lambda _: self.submitted.pop(request_id, None))
        return request_id

    def validate_pooling(self, token_ids: list[int], pooling: PoolingParams) -> None:
        self.front.validate_pooling(token_ids, pooling)

    def abort(self, request_id: str) -> None:
        task = self.submitted.get(request_id)
        if task is not None:  # cancelling it closes the request's stream, which aborts it on its replica
            task.cancel()
        index = self.inflight.get(request_id)
        if index is not None:
            self.replicas[index].abort.remote(request_id)

    def loop(self) -> BackgroundLoop:
        if self.background is None:
            self.background = BackgroundLoop()
        return self.background

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.front.tokenize(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams, lora: LoRASpec | None = None) -> None:
        self.loras.resolve(lora)
        self.front.validate(token_ids, params)

    def stats(self) -> dict[str, Any]:
        """The live replicas' stats summed (see ReplicaFront.stats); each replica answers from its engine thread."""
        return self.front.stats()

    @property
    def supports_lora(self) -> bool:
        """Whether the replicas were built with enable_lora=True (launch(..., enable_lora=True))."""
        return self.loras.enabled

    def list_loras(self) -> list[str]:
        return self.loras.names()

    def add_lora(self, name: str, source: Any) -> None:
        """Register an adapter (a PEFT folder, which every replica must be able to read at that path, a
        loaded PeftModel's active adapter, or `LoRAWeights`) on every live replica; a replica started or
        restarted later reads it when a request first names it there. ValueError (the engine's) if it
        does not fit. Blocks until the replicas have it."""
        self.loras.add(name, source)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter on every replica (ValueError naming the known ones when unknown)."""
        self.loras.remove(name)

    def is_alive(self) -> bool:
        """Whether any replica can still take requests (what the server's /health reports)."""
        return self.router.num_alive() > 0

    def shutdown(self) -> None:
        """Stop the client's thread; kill the replicas if this client launched them."""
        if self.background is not None:
            self.background.close()
            self.background = None
        if self.owns_replicas:
            kill_all(self.replicas)
            for index in range(len(self.replicas)):
                self.router.mark_dead(index, "shut down")

    # ------------------------------------------------------------ one request

    def prepare(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                lora: LoRASpec | None = None
                ) -> tuple[SamplingParams, str | None, list[int], str, ShippedLoRA | None]:
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        shipped = self.loras.resolve(lora)
        self.front.validate(token_ids, params)
        if request_id is None:
            request_id = f"{self.id_prefix}-{next(self.ids)}"
        elif request_id in self.inflight:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return params, text, token_ids, request_id, shipped

    async def attempts(self, prompt: Prompt, text: str | None, token_ids: list[int], params: SamplingParams,
                       request_id: str, stream: bool, processor: LogitsProcessor | None = None,
                       lora: ShippedLoRA | None = None) -> AsyncIterator[RequestOutput]:
        """Run the request on up to `max_attempts` replicas in turn, until one answers."""
        salt = None if lora is None else lora.prefix_salt
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        tried: list[int] = []
        last: RequestOutput | None = None
        error = "no attempt was made"
        for attempt in range(self.max_attempts):
            try:
                index = await self.choose(token_ids, tried, deadline, salt)
            except NoLiveReplicaError as exc:
                error = str(exc) + (f"; before that: {error}" if tried else "")
                break
            tried.append(index)
            self.num_retries += attempt > 0
            self.inflight[request_id] = index
            try:
                run = self.run_on(index, prompt, params, request_id, stream, deadline, processor, lora)
                async with contextlib.aclosing(run) as outputs:
                    async for output in outputs:
                        last = output
                        yield output
                return
            except RayActorError as exc:
                error = f"replica {index} failed: {first_line(exc)}"
                if isinstance(exc, ActorDiedError):
                    self.router.mark_dead(index, first_line(exc))
                if last is not None:
                    error += (f" after {len(last.outputs[0].token_ids)} tokens were streamed; not retried, "
                              "since a rerun elsewhere could change what was already delivered")
                    break
            except TimeoutError:
                error = (f"no answer from replica {index} within request_timeout_s={self.request_timeout_s}; "
                         "the request was aborted")
                break
            except RayTaskError as exc:  # the replica raised; another would raise the same
                error = f"replica {index} raised {exc.cause!r}"
                break
            finally:
                self.router.release(index)
                self.inflight.pop(request_id, None)
        yield failed_output(request_id, text, token_ids, error, last)

    async def choose(self, token_ids: list[int], tried: list[int], deadline: float | None,
                     salt: str | None = None) -> int:
        """A replica not tried yet; failing that, with restartable replicas, a tried one once Ray has
        brought it back (calls to a restarting actor fail at once, so the retry waits for it)."""
        try:
            return self.router.choose(token_ids, exclude=tried, salt=salt)
        except NoLiveReplicaError:
            back = await self.restarted(tried, deadline) if self.restartable else None
            if back is None:
                raise
            return self.router.choose(token_ids, exclude=[i for i in range(len(self.replicas)) if i != back],
                                      salt=salt)

    async def restarted(self, tried: list[int], deadline: float | None) -> int | None:
        """The first of `tried` that answers again after a restart; None if none does before the deadline."""
        waiting = [i for i in dict.fromkeys(tried) if self.router.alive[i]]
        limit = deadline if deadline is not None else time.monotonic() + RESTART_WAIT_S
        while waiting and time.monotonic() < limit:
            for index in list(waiting):
                try:
                    await wait_until(self.replicas[index].describe.remote(), limit)
                    return index
                except ActorDiedError as exc:  # out of restarts
                    self.router.mark_dead(index, first_line(exc))
                    waiting.remove(index)
                except (RayActorError, TimeoutError):  # still restarting
                    pass
            await asyncio.sleep(RESTART_POLL_S)
        return None

    async def run_on(self, index: int, prompt: Prompt, params: SamplingParams, request_id: str, stream: bool,
                     deadline: float | None, processor: LogitsProcessor | None = None,
                     lora: ShippedLoRA | None = None) -> AsyncIterator[RequestOutput]:
        replica = self.replicas[index]
        finished = False
        try:
            if not stream:
                output = await wait_until(replica.complete.remote(prompt, params, request_id, processor, lora),
                                          deadline)
                finished = True
                yield output
                return
            refs = replica.generate.remote(prompt, params, request_id, processor, lora)
            while not finished:
                output = await wait_until(await wait_until(refs.__anext__(), deadline), deadline)
                finished = output.finished
                yield output
        except ActorDiedError:
            finished = True  # nothing left to abort
            raise
        finally:
            if not finished:  # the caller stopped listening, or the deadline passed: free the blocks
                replica.abort.remote(request_id)


async def wait_until(awaitable: Awaitable[T], deadline: float | None) -> T:
    if deadline is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))


def kill_all(replicas: Sequence[ActorHandle]) -> None:
    for replica in replicas:
        with contextlib.suppress(Exception):
            ray.kill(replica)
