"""Request: one prompt's journey through the engine (tokens, progress, blocks, stop state)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from paged_backend.core.outputs import Logprob, RequestMetrics, SampleLogprobs
from paged_backend.core.request_group import RequestGroup

if TYPE_CHECKING:
    from paged_backend.core.image_span import ImageSpan, RopePositions
    from paged_backend.core.pooling import PoolingParams
    from paged_backend.model.lora import LoRAAdapter
    from paged_backend.sampling.detokenizer import IncrementalDetokenizer
    from paged_backend.sampling.grammar import GrammarState
    from paged_backend.sampling.sampling_params import SamplingParams

# vLLM's form: the request's output token ids so far and its logits row [V], returning the row to sample from.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class PenaltyState:
    """What the penalties need of a request's history, kept up to date incrementally by the sampler."""

    seen: torch.Tensor  # [V] bool: in the prompt or the output
    counts: torch.Tensor  # [V] float: occurrences in the output
    synced: int  # output tokens already counted


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    stop_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    metrics: RequestMetrics
    stream: bool = True  # emit an output after every new token, or only the final one
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # proposed tokens scheduled after the last token
    num_draft_computed: int = 0  # positions whose K/V a draft model has written (draft_proposer.py)
    spec_allowance: int = 0  # proposals it may carry next step (per-request policy; 0: k)
    spec_pause: int = 0  # steps it sits out before proposing again
    spec_misses: int = 0  # verifications in a row that kept none of its proposals
    spec_acceptance: float | None = None  # its estimated share of proposals kept (None: no verification yet)
    draft_probs: torch.Tensor | None = None  # [proposals, V]: the draft distributions sampled proposals came from
    # One block table per layer group (kv_cache_groups.py); a model without windows has one. A window group's
    # entries before its window hold the KV cache manager's null block once their blocks are freed.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[int] = field(default_factory=list)  # of the leading full blocks, once computed
    cache_salt: str | None = None  # isolates this request's prefix-cache entries from other tenants'
    lora: LoRAAdapter | None = None  # the adapter it runs with (None: the base model)
    model_state: int | None = None  # the state of the model's weights and adapters it was made under (model_state.py)
    lora_slot: int = 0  # while running: the device slot of its adapter (0: the base)
    state_slot: int | None = None  # a hybrid model's recurrent-state row while it holds blocks (state_slots.py)
    # Preempted to be recomputed: on resuming it reads nothing back from the second tier (kv_offload/offloader.py).
    recompute: bool = False
    prompt_key: int | None = None  # its prompt and first block's key, hashed once it waits (KVCacheManager.prompt_key)
    # The user's request this is a sample of (n, best_of); None: a group of its own, made at construction.
    group: RequestGroup = None  # type: ignore[assignment]
    index: int = field(init=False, default=0)  # which of its group's samples this is (joined at construction)
    logits_processor: LogitsProcessor | None = None  # (output ids, row [V]) -> row, before sampling
    penalty_state: PenaltyState | None = None  # built on first use by the sampler
    grammar: GrammarState | None = None  # structured outputs: the matcher its tokens must satisfy
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, entry per later prompt token]
    num_cached_tokens: int = 0
    error: str | None = None
    # A pooling request (core/pooling.py): its prompt's final hidden states become an embedding; nothing is sampled.
    pooling: PoolingParams | None = None
    pooled: torch.Tensor | None = None  # while it runs: the sum (mean) or the last row of its hidden states so far
    images: tuple[ImageSpan, ...] = ()  # a vision-language prompt's images, in prompt order (image_span.py)
    rope: RopePositions | None = None  # its multi-axis positions, on a model that takes them (Qwen2-VL's M-RoPE)

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = RequestGroup(self.request_id)
        self.index = self.group.join(self)

    @property
    def block_ids(self) -> list[int]:
        """The first layer group's block table: the only one of a model without windows."""
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, ids: list[int]) -> None:
        self.block_tables[0] = ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_logprob(self) -> bool:
        """Whether the sampler must report this request's chosen-token logprobs (asked for, or to rank it)."""
        return self.logprobs is not None or self.group.ranked

    @property
    def mean_logprob(self) -> float:
        """The score best_of ranks samples by: log probability per generated token."""
        return self.cumulative_logprob / max(1, len(self.output_token_ids))

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens `[start, stop)` of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]
