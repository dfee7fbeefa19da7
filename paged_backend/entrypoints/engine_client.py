"""EngineClient: everything a front end (the server, LangChain, Ray's ingress) may ask of an engine.

Front ends hold one of these and nothing else: never the `Engine` it wraps, never its fields. Two
classes implement it: `AsyncEngine` (one engine stepped by its own thread, in this process) and the
Ray `ReplicatedAsyncEngine` (requests routed to engine replicas in other processes). A test of a route
can pass a small fake of its own. (The offline integrations, `generate(cache_implementation="paged")`,
its beam and PEFT forms and the pipeline, drive an `Engine` of their own step by step, as `LLM` does:
they are not clients of a shared engine.)

Every member is safe to call from any thread: requests and aborts are queued for whatever steps the
engine, and `stats()` is answered by that stepper, never read while it steps. The limits
(`max_model_len`, `vocab_size`, `eos_token_ids`), `tokenizer` and `image_prompts` are fixed when the client is
built.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from paged_backend.core.outputs import RequestOutput
from paged_backend.core.pooling import PoolingParams
from paged_backend.core.request import LogitsProcessor
from paged_backend.image_prompts import ImagePrompts, ProcessedPrompt
from paged_backend.model.lora import LoRASpec
from paged_backend.sampling.sampling_params import SamplingParams

Prompt = str | Sequence[int] | ProcessedPrompt
Sink = Callable[[RequestOutput], None]


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # the engine's tokenizer (None when it was built without one)
    max_model_len: int  # prompt + output tokens one request may hold
    vocab_size: int  # token ids run 0 .. vocab_size - 1
    eos_token_ids: frozenset[int]  # the tokens that end a request unless it ignores EOS
    # What reads a chat's images (image_prompts.py) where the engine runs images for its model; None: images are
    # refused. A prompt it made (a ProcessedPrompt) is a prompt `generate` and `submit` take.
    image_prompts: ImagePrompts | None

    # ------------------------------------------------------------ requests

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                 logits_processor: LogitsProcessor | None = None,
                 lora: LoRASpec | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they change; the last has `finished=True`. Leaving early
        aborts it. An invalid request raises ValueError before anything runs."""
        ...

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               logits_processor: LogitsProcessor | None = None,
               lora: LoRASpec | None = None) -> Iterator[RequestOutput]:
        """The same as `generate`, for plain threads."""
        ...

    def submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, sink: Sink,
               logits_processor: LogitsProcessor | None = None, lora: LoRASpec | None = None) -> str:
        """Validate (ValueError here), queue the request and return its id; every output is handed to
        `sink`, on a thread of the client's, until one has `finished=True`."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop the request; its blocks are freed at the engine's next step. Unknown ids are ignored."""
        ...

    # ------------------------------------------------------------ embeddings (pooling requests)

    async def embed(self, prompt: Prompt, pooling: PoolingParams | None = None,
                    request_id: str | None = None) -> RequestOutput:
        """The prompt's finished output, its `embedding` set (core/pooling.py); cancelling aborts it. An
        invalid request raises ValueError before anything runs."""
        ...

    def submit_pooling(self, prompt: Prompt, pooling: PoolingParams | None, request_id: str | None,
                       sink: Sink) -> str:
        """Validate (ValueError here), queue the pooling request and return its id; its one finished
        output is handed to `sink` on a thread of the client's."""
        ...

    def validate_pooling(self, token_ids: list[int], pooling: PoolingParams) -> None:
        """Raise ValueError (naming what is wrong) for a pooling request the engine would refuse."""
        ...

    # ------------------------------------------------------------ checks, without running anything

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids) of a prompt, as the engine would see them."""
        ...

    def validate(self, token_ids: list[int], params: SamplingParams, lora: LoRASpec | None = None) -> None:
        """Raise ValueError (naming what is wrong) for a request the engine would refuse."""
        ...

    # ------------------------------------------------------------ state

    def stats(self) -> dict[str, Any]:
        """The engine's counters (`Engine.stats` keys; a replicated engine sums its replicas')."""
        ...

    def is_alive(self) -> bool:
        """Whether requests can still be served (what the server's /health reports)."""
        ...

    def shutdown(self) -> None:
        ...

    # ------------------------------------------------------------ LoRA adapters

    @property
    def supports_lora(self) -> bool:
        """Whether requests may name adapters and adapters may be added at run time."""
        ...

    def list_loras(self) -> list[str]:
        ...

    def add_lora(self, name: str, source: Any) -> None:
        """Register an adapter (a PEFT folder or a loaded PeftModel); ValueError if it does not fit."""
        ...

    def remove_lora(self, name: str) -> None:
        """Forget an adapter (ValueError when unknown); requests already running with it finish."""
        ...
