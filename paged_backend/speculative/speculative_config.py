"""SpeculativeConfig: how the engine proposes extra tokens for decoding requests (vLLM's vocabulary).

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}`:
the last n..m tokens of a request are looked up earlier in its own prompt and output, and the k tokens
that followed the match are proposed.
`{"method": "draft_model", "model": <hub id, folder or loaded HF model>, "num_speculative_tokens": k}`:
a smaller model sharing the target's tokenizer proposes k tokens, running in the same engine.
Either way the target model verifies the proposals in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# A hard cap on the size of a step that takes proposals; below it the per-request gate decides.
DEFAULT_MAX_STEP_TOKENS = 512
# The step size (tokens) at which a step's per-token work equals its fixed cost (reading the weights,
# dispatch). A proposal pays when its chance of being kept beats T / (T + knee) for a step of T tokens
# (speculation.py), so the bar follows the step's size rather than one cut-off. Fitted on the default
# model's CPU steps; of the knees compared side by side, this one kept MT-bench closest to plain
# (docs/speculative-decoding.md has the fit and the comparison).
DEFAULT_KNEE_TOKENS = 16
DEFAULT_LOOKUP_MAX = 3
DEFAULT_LOOKUP_MIN = 2


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    # The per-step policy: proposals are added only while the step holds at most this many tokens.
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    # The per-request policy: each request's proposal count follows what it kept, and it proposes in a
    # step of T tokens only while its acceptance estimate is at least T / (T + knee_tokens) (speculation.py).
    adapt_per_request: bool = True
    knee_tokens: int = DEFAULT_KNEE_TOKENS
    # draft_model: a hub id, a folder or a loaded PreTrainedModel (compared by identity).
    model: Any = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r}: must be one of {METHODS}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a hub id, folder or loaded model)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config 'model' is for method 'draft_model', not 'ngram'")
        if not isinstance(self.adapt_per_request, bool):
            raise ValueError(f"speculative_config adapt_per_request={self.adapt_per_request!r}: must be a bool")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_step_tokens", "knee_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r}: must be an int >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} is larger than "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """Accept a config, a dict of its fields (vLLM's form; a missing lookup bound defaults so that
        min <= max; a "model" without a method means a draft model) or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        fields = dict(value)
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}")
        if "model" in fields and "method" not in fields:
            fields["method"] = "draft_model"
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if low is not None and high is None:
            fields["prompt_lookup_max"] = max(low, DEFAULT_LOOKUP_MAX)
        elif high is not None and low is None:
            fields["prompt_lookup_min"] = min(high, DEFAULT_LOOKUP_MIN)
        return cls(**fields)
