"""Pooling requests: a prompt's final hidden states made into one embedding instead of sampled tokens.

A pooling request runs through the packed step like the prefill of any request (chunked, batched with
generation, preemptible), but it starts from nothing (no prefix-cache lookup: mean pooling needs every
position's hidden state) and registers no block, so it leaves no KV behind; it finishes, and frees its
blocks, at the step that computes its last prompt token. Each step the runner hands over the final
hidden states of the rows a pooling request needs (`PoolingRows`): for mean pooling every row of its
chunk, summed into `Request.pooled`; for last-token pooling the row of its last token. A chunk that
starts at position 0 (the first, or the first after a preemption) restarts the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from paged_backend.errors import check_context

if TYPE_CHECKING:
    from paged_backend.core.request import Request

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    pooling: Literal["last", "mean"] = "last"  # the last token's hidden state, or the mean over the prompt
    normalize: bool = True  # L2-normalise the vector (what embedding clients expect)
    dimensions: int | None = None  # keep the first k components (Matryoshka models only), before normalising

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


def matryoshka_dimensions(config) -> tuple[int, ...] | None:
    """The truncated sizes a model was trained to keep meaningful (its config's `matryoshka_dimensions`, or
    any size when `is_matryoshka` is set: sentence-transformers' and vLLM's flags); None for any other model."""
    hidden = config.get_text_config().hidden_size
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return tuple(sorted(int(d) for d in dims if 0 < int(d) <= hidden))
    return tuple(range(1, hidden + 1)) if getattr(config, "is_matryoshka", False) else None


def check_pooling(token_ids: list[int], pooling: PoolingParams, *, max_model_len: int, vocab_size: int,
                  hidden_size: int, embedding_sizes: tuple[int, ...] | None, context_note: str = "") -> None:
    """The checks a pooling request passes before it is queued (shared by the engine and clients that check
    on its behalf): ValueError naming an empty input, one longer than the context, tokens outside the
    vocabulary, `dimensions` the model does not support."""
    if not isinstance(pooling, PoolingParams):
        raise ValueError(f"pooling must be PoolingParams, got {type(pooling).__name__}")  # noqa: TRY004
    if not token_ids:
        raise ValueError("the input is empty")
    check_context(max_model_len, len(token_ids), 0, note=context_note, what="input")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    check_dimensions(pooling, hidden_size, embedding_sizes)


def check_dimensions(params: PoolingParams, hidden_size: int, supported: tuple[int, ...] | None) -> None:
    """`dimensions` is the model's own size or, for a Matryoshka model, one of its sizes; ValueError otherwise."""
    wanted = params.dimensions
    if wanted is None or wanted == hidden_size:
        return
    if supported is None:
        raise ValueError(f"dimensions={wanted}: this model's embeddings have {hidden_size} dimensions and it was not "
                         "trained to be truncated (no matryoshka_dimensions in its config)")
    if wanted not in supported:
        raise ValueError(f"dimensions={wanted}: this model supports {list(supported)[:16]}")


@dataclass(slots=True)
class PoolingRows:
    """What one step's pooling requests take from the final hidden states `[T, H]` of its packed row."""

    requests: list[Request]  # the pooling requests that take rows this step
    rows: torch.Tensor  # [R] packed rows taken
    segments: torch.Tensor  # [R] the index in `requests` of each taken row
    restarts: list[bool]  # whether the request's chunk starts at position 0 (its sum starts afresh)

    def reduce(self, hidden: torch.Tensor) -> None:
        """Add each request's rows (in fp32) to its running `pooled` state."""
        picked = hidden.index_select(0, self.rows).float()
        sums = torch.zeros(len(self.requests), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, self.segments, picked)
        for request, restart, row in zip(self.requests, self.restarts, sums):
            request.pooled = row if restart or request.pooled is None else request.pooled + row


def pooling_rows(requests: list[Request], starts: np.ndarray, ends: np.ndarray, query_start_loc: np.ndarray,
                 to_device) -> PoolingRows | None:
    """The rows this step's pooling requests take (None when there are none): a mean request every row of
    its chunk, a last-token request its last row, at the step that computes it."""
    taken, rows, segments, restarts = [], [], [], []
    for i, request in enumerate(requests):
        params = request.pooling
        if params is None:
            continue
        first, count = int(query_start_loc[i]), int(ends[i] - starts[i])
        if params.pooling == "mean":
            chunk = np.arange(first, first + count)
        elif ends[i] == request.num_tokens:
            chunk = np.array([first + count - 1])
        else:
            continue
        rows.append(chunk)
        segments.append(np.full(len(chunk), len(taken)))
        restarts.append(bool(starts[i] == 0))
        taken.append(request)
    if not taken:
        return None
    return PoolingRows(taken, to_device(np.concatenate(rows)), to_device(np.concatenate(segments)), restarts)


def embedding_of(request: Request) -> torch.Tensor:
    """The finished request's embedding: the last row or the mean, truncated to `dimensions`, normalised;
    fp32 on the CPU."""
    params = request.pooling
    vector = request.pooled if params.pooling == "last" else request.pooled / request.num_prompt_tokens
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.cpu()
