"""StepInputs: one step's packed forward as the model runner hands it to the model, to the decode padding and
CUDA graphs, and to the other tensor-parallel ranks."""

from __future__ import annotations

from typing import NamedTuple

import torch

from paged_backend.core.pooling import PoolingRows
from paged_backend.core.request import Request
from paged_backend.kernels import AttentionMetadata
from paged_backend.model.paged.recurrent_state import RecurrentStep
from paged_backend.model.paged.step_context import LoRAStep
from paged_backend.sampling.prompt_logprobs import PromptSpan


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]; [3, 1, T] for a model of multi-axis positions (M-RoPE)
    logits_indices: torch.Tensor  # [S] rows of the packed batch whose logits are needed
    sampling_requests: list[Request]
    metadata: AttentionMetadata
    # Kept logits rows after the sampling ones, scoring prompt tokens (rank 0 only; see prompt_logprobs.py).
    prompt_spans: tuple[PromptSpan, ...] = ()
    lora: LoRAStep | None = None  # the step's adapter segments (None: every token runs the base)
    # A padded decode step (decode_padding.py): the first `real_rows` logits rows are its own, the rest
    # padding's. None: not padded.
    real_rows: int | None = None
    # A cache of layer groups (kv_cache_groups.py): the metadata of each group, `metadata` the first's. None: one.
    group_metadata: tuple[AttentionMetadata, ...] | None = None
    # The rows the step's pooling requests take from the final hidden states (None: no pooling request).
    pooling: PoolingRows | None = None
    # A hybrid model's step (recurrent_state.py): each sequence's segment, progress and state slot. None: no state.
    recurrent: RecurrentStep | None = None
    # A step of a vision-language model with image placeholders: its input embeddings [1, T, hidden], image rows in
    # place (step_images.py), run eagerly instead of `input_ids`. None: the token ids alone.
    inputs_embeds: torch.Tensor | None = None
