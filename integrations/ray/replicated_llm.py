"""ReplicatedLLM: `LLM.generate` (many prompts -> outputs in input order) over K engine replicas."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from paged_backend.core.outputs import RequestOutput
from paged_backend.entrypoints.llm import (
    checked_token_ids,
    normalise_loras,
    normalise_params,
    normalise_prompts,
)
from paged_backend.model.lora import LoRASpec, portable_source
from paged_backend.sampling.sampling_params import SamplingParams

from .replica import Prompt
from .replicated_engine import DEFAULT_TIMEOUT_S, ReplicatedAsyncEngine


class ReplicatedLLM:
    """`ReplicatedLLM(model, num_replicas)` starts that many EngineReplica actors on the running Ray
    cluster (each loads `model` itself) and routes every prompt to one of them. Extra keywords are
    LLM / EngineConfig keywords, given to every replica (`enable_lora=True, max_loras=..,
    max_lora_rank=..` as with `LLM`; then `add_lora` registers an adapter on every replica)."""

    def __init__(self, model: str | os.PathLike | None = None, num_replicas: int = 2, *,
                 tokenizer: str | os.PathLike | None = None, num_cpus: float = 1, num_gpus: float = 0,
                 prefix_aware: bool = False, balance_slack: int = 8,
                 request_timeout_s: float | None = DEFAULT_TIMEOUT_S, max_attempts: int = 2, max_restarts: int = 0,
                 **engine_config: Any) -> None:
        self.aengine = ReplicatedAsyncEngine.launch(
            model, num_replicas, tokenizer=tokenizer, num_cpus=num_cpus, num_gpus=num_gpus,
            prefix_aware=prefix_aware, balance_slack=balance_slack, request_timeout_s=request_timeout_s,
            max_attempts=max_attempts, max_restarts=max_restarts, **engine_config)

    @property
    def tokenizer(self) -> Any:
        return self.aengine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: LoRASpec | Sequence[LoRASpec | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. As with `LLM.generate`, every
        prompt is validated first, so an invalid one raises ValueError (naming its index) and none runs.
        A request whose replicas all failed comes back finished with `error` set. `lora`: one adapter
        (name or LoRARequest) for every prompt, or one per prompt (None: the base), as with `LLM`."""
        prompts = normalise_prompts(prompts)
        params = normalise_params(sampling_params, len(prompts))
        loras = normalise_loras(lora, len(prompts))
        checked_token_ids(self.aengine.tokenize, self.aengine.validate, prompts, params, loras)
        with tqdm(total=len(prompts), disable=not use_tqdm, desc="Generating", unit="req") as bar:
            return self.aengine.loop().run(self.aengine.run_batch(prompts, params, lambda: bar.update(1), loras))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               lora: LoRASpec | None = None) -> Iterator[RequestOutput]:
        """One request's outputs as they change, for plain threads (see ReplicatedAsyncEngine.generate)."""
        return self.aengine.stream(prompt, params, lora=lora)

    def add_lora(self, name: str, source: Any, adapter_name: str | None = None) -> None:
        """Register a LoRA adapter on every replica (see ReplicatedAsyncEngine.add_lora); of a PeftModel,
        its `adapter_name` (by default the active one), as `LLM.add_lora` takes it."""
        self.aengine.add_lora(name, portable_source(source, adapter_name))

    def remove_lora(self, name: str) -> None:
        self.aengine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.aengine.list_loras()

    def stats(self) -> dict[str, Any]:
        return self.aengine.stats()

    def shutdown(self) -> None:
        """Kill the replicas and stop the client thread."""
        self.aengine.shutdown()
