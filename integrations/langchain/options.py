"""Options shared by PagedLLM and ChatPaged: which engine, how to sample, how to wait.

Every constructor field can be overridden per call (`invoke(..., temperature=0)`); anything
else a caller passes is refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from paged_backend import AsyncEngine, SamplingParams
from paged_backend.integrations.options import defaults
from paged_backend.integrations.options.vocabularies import LANGCHAIN

from .engines import describe_model, get_async_engine

# The options a constructor field sets and a call may override (LANGCHAIN's table); stop strings merge.
SAMPLING_FIELDS = tuple(name for name in LANGCHAIN.rules if name != "stop")


class PagedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: Any = None
    """None (the default model), a hub id, folder or .gguf path, a loaded PreTrainedModel or PEFT
    model, or a ready paged_backend.LLM / Engine / AsyncEngine."""
    tokenizer: Any = None
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields plus dtype/device; adapters with equal settings share one engine."""
    model_name: str | None = None
    """Reported as model_name; defaults to the model's name or path."""

    temperature: float = defaults.LANGCHAIN["temperature"]
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = defaults.LANGCHAIN["max_tokens"]
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    """Sample this many and keep the n with the best log probability per token (not with streaming)."""
    structured_outputs: dict[str, Any] | None = None
    """Hold every answer to a shape, in vLLM's vocabulary: {"json": schema}, {"json_object": True},
    {"regex": ...}, {"choice": [...]} or {"grammar": EBNF}, optionally with "disable_any_whitespace"."""
    truncate_prompt_tokens: int | None = None
    """Answer from the prompt's last k tokens only (-1: as many as the engine's context holds)."""
    stop: list[str] | None = None
    """Stop strings; a call's `stop` is added to these, and the text is cut before the match."""
    timeout: float | None = None
    """Seconds one engine request may take; past it the request is aborted and TimeoutError raised."""
    streaming: bool = False
    lora: Any = None
    """A LoRA adapter of the engine to answer with: its name, or a paged_backend.LoRARequest (whose path
    registers it on first use); the engine needs engine_config={"enable_lora": True}. None: the base."""

    _aengine: AsyncEngine | None = PrivateAttr(default=None)

    @property
    def async_engine(self) -> AsyncEngine:
        """The shared engine, built on first use so that construction stays cheap."""
        if self._aengine is None:
            self._aengine = get_async_engine(self.model, self.tokenizer, self.engine_config)
        return self._aengine

    @property
    def resolved_model_name(self) -> str:
        return self.model_name or describe_model(self.model)

    def sampling_params(self, stop: list[str] | None, overrides: dict[str, Any], **extra: Any) -> SamplingParams:
        """Constructor fields, then the call's overrides, through LangChain's table; stop strings are the
        union of both. `extra` are fields in SamplingParams' own names (logprobs, ...)."""
        values = {name: overrides.pop(name, getattr(self, name)) for name in SAMPLING_FIELDS}
        values["stop"] = merge_stops(self.stop, overrides.pop("stop", None) or stop)
        overrides.pop("timeout", None)
        overrides.pop("lora", None)
        refuse_unknown(overrides)
        return LANGCHAIN.params(values, **extra)

    def call_timeout(self, kwargs: dict[str, Any]) -> float | None:
        return kwargs.get("timeout", self.timeout)

    def call_lora(self, kwargs: dict[str, Any]) -> Any:
        """The call's adapter (`bind(lora=...)` or `invoke(..., lora=...)`), else the constructor's."""
        return kwargs.get("lora", self.lora)


def merge_stops(*groups: list[str] | None) -> list[str]:
    merged: list[str] = []
    for group in groups:
        merged.extend(s for s in group or [] if s not in merged)
    return merged


def refuse_unknown(kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise NotImplementedError(f"unsupported call options: {', '.join(sorted(kwargs))}")
