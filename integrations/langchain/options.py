"""Options shared by PagedLLM and ChatPaged: which engine, how to sample, how to wait.

Every constructor field can be overridden per call (`invoke(..., temperature=0)`); anything
else a caller passes is refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, PrivateAttr

from paged_backend.entrypoints.async_engine import AsyncEngine
from paged_backend.integrations.options.schema import options_model
from paged_backend.integrations.options.vocabularies import LANGCHAIN
from paged_backend.sampling.sampling_params import SamplingParams

from .engines import describe_model, get_async_engine

# The options a constructor field sets and a call may override (LANGCHAIN's table); stop strings merge.
SAMPLING_FIELDS = tuple(name for name in LANGCHAIN.rules if name != "stop")


CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

# The sampling fields (temperature, max_tokens, stop, ...), generated from the LANGCHAIN table's rows:
# type, default and description.
LangChainSamplingOptions = options_model("LangChainSamplingOptions", LANGCHAIN, CONFIG)


class PagedOptions(LangChainSamplingOptions):
    """The LANGCHAIN table's sampling options (inherited), and which engine and how to wait."""

    model_config = CONFIG

    model: Any = None
    """None (the default model), a hub id, folder or .gguf path, a loaded PreTrainedModel or PEFT
    model, or a ready paged_backend.LLM / Engine / AsyncEngine."""
    tokenizer: Any = None
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields plus dtype/device; adapters with equal settings share one engine."""
    model_name: str | None = None
    """Reported as model_name; defaults to the model's name or path."""

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
