"""SamplingParams: how one request is decoded and when it stops (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from paged_backend.sampling.structured_outputs import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sample this many (>= n) and return the n with the best mean token logprob
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (0: the token's own only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The answer must match a JSON Schema, regex, choice or grammar (a dict of its fields is accepted too).
    structured_outputs: StructuredOutputsParams | None = None
    # Run only the prompt's last k tokens; -1: the most the context holds (max_model_len - 1). None: all.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self.validate()

    @property
    def num_samples(self) -> int:
        """How many samples the engine runs: best_of when set, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def kept_prompt(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt tokens a request runs: the last truncate_prompt_tokens of them, else all."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            keep = max(1, max_model_len - 1)  # room for the one token every request generates
        return token_ids[-keep:] if keep is not None and len(token_ids) > keep else token_ids

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of a multi-sample request: one sample, a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, best_of=None, seed=seed)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n", self.n, "must be an int >= 1")
        check(self.best_of is None or (isinstance(self.best_of, int) and not isinstance(self.best_of, bool)
                                       and self.best_of >= self.n), "best_of", self.best_of,
              f"must be an int >= n ({self.n}) or None")
        check_number(self.temperature, "temperature", lambda x: x >= 0, "must be >= 0")
        check(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k", self.top_k,
              "must be an int >= 0, or -1 to disable")
        check_number(self.top_p, "top_p", lambda x: 0 < x <= 1, "must be in (0, 1]")
        check_number(self.min_p, "min_p", lambda x: 0 <= x <= 1, "must be in [0, 1]")
        check_number(self.repetition_penalty, "repetition_penalty", lambda x: x > 0, "must be > 0")
        check_number(self.presence_penalty, "presence_penalty", lambda x: -2 <= x <= 2, "must be in [-2, 2]")
        check_number(self.frequency_penalty, "frequency_penalty", lambda x: -2 <= x <= 2,
                     "must be in [-2, 2]")
        check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an int or None")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", self.max_tokens, "must be an int >= 1 or None")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
              "must be an int >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
              f"must be <= max_tokens ({self.max_tokens})")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
              self.stop, "must be a list of non-empty strings")
        check(isinstance(self.stop_token_ids, list) and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", self.stop_token_ids, "must be a list of non-negative ints")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs",
              self.logprobs, "must be an int >= 0 or None")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
              "prompt_logprobs", self.prompt_logprobs, "must be an int >= 0 or None")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", self.structured_outputs, "must be StructuredOutputsParams or None")
        keep = self.truncate_prompt_tokens
        check(keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and (keep >= 1 or keep == -1)),
              "truncate_prompt_tokens", keep, "must be an int >= 1, -1 (what the context holds) or None")


def check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r}: {rule}")


def check_number(value: object, name: str, ok: Callable[[float], bool], rule: str) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    check(is_number and ok(value), name, value, rule)
