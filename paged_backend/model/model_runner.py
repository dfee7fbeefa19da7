"""ModelRunner: turns a scheduled batch into one packed forward of the unmodified HF model.

Inputs are built with numpy over the whole batch (no Python work per token): the new tokens of
every request are packed into one row `[1, T]` with their positions, cache slots, block tables and
query offsets, and logits are computed only at the last position of requests that sample (and at
the positions of the proposed tokens a request carries, which speculation verifies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from paged_backend.core.pooling import PoolingRows, pooling_rows
from paged_backend.core.request import Request
from paged_backend.core.scheduler import ScheduledBatch
from paged_backend.kernels import AttentionMetadata
from paged_backend.kernels.torch_single_row import single_row_step
from paged_backend.model import compilation, custom_ops, lora
from paged_backend.model.paged_cache import PagedCache
from paged_backend.model.small_step_linear import small_step_linear
from paged_backend.sampling.prompt_logprobs import PromptSpan, wanted_targets

if TYPE_CHECKING:
    from paged_backend.model.cuda_graphs import DecodeGraphs
    from paged_backend.model.decode_padding import DecodePadding


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S] rows of the packed batch whose logits are needed
    sampling_requests: list[Request]
    metadata: AttentionMetadata
    # Kept logits rows after the sampling ones, scoring prompt tokens (rank 0 only; see prompt_logprobs.py).
    prompt_spans: tuple[PromptSpan, ...] = ()
    lora: lora.LoRAStep | None = None  # the step's adapter segments (None: every token runs the base)
    # A padded decode step (decode_padding.py): the first `real_rows` logits rows are its own, the rest
    # padding's. None: not padded.
    real_rows: int | None = None
    # The rows the step's pooling requests take from the final hidden states (None: no pooling request).
    pooling: PoolingRows | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedCache,
                 publish: Callable[[StepInputs], None] | None = None, lora_slots: lora.LoRASlots | None = None) -> None:
        self.model = model
        self.lora_slots = lora_slots
        self.forward_model: Callable = model  # what runs the step: the model, or its compiled forward (compile())
        self.cache = cache
        self.device = cache.kv.device
        self.publish = publish  # tensor parallelism: hands each step's inputs to the other ranks
        self.padding: DecodePadding | None = None  # pads decode-only steps, when the engine asks
        self.graphs: DecodeGraphs | None = None  # replays padded decode steps on CUDA, once captured
        self.compiled_structure: tuple | None = None  # the model's structure its forward was compiled for

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepInputs]:
        """Run one forward; return the kept logits and the step's inputs: the first rows are those of
        `inputs.sampling_requests` (the requests that reach their last token; 1 + its proposals for a request
        carrying proposed tokens), then those of `inputs.prompt_spans`.
        The caller holds `torch.inference_mode()` over this and the sampling that follows."""
        inputs = self.prepare_inputs(batch)
        # A step with pooling requests runs unpadded and eagerly (forward_pooling): a captured graph has no hook.
        size = self.padding.size_for(inputs) if self.padding is not None and inputs.pooling is None else None
        if size is not None:  # before publishing: every tensor-parallel rank runs the same padded step
            inputs = self.padding.pad(inputs, size)
        if self.publish is not None:
            self.publish(inputs)
        return self.forward(inputs), inputs

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        with (custom_ops.step_context(inputs.metadata, self.cache.kv, self.cache.kv_scales),
              lora.step_context(inputs.lora)):
            if inputs.pooling is not None:
                return self.forward_pooling(inputs)
            logits = self.graphs.replay(inputs) if self.graphs is not None and inputs.real_rows is not None else None
            if logits is None:
                # Eager only: the compiled forward has its own matmul choices.
                tokens = inputs.input_ids.shape[-1] if not self.compiled else 0
                with small_step_linear(tokens, self.device):
                    logits = self.run_model(inputs.input_ids, inputs.position_ids, inputs.logits_indices,
                                            inputs.metadata)
        return logits if inputs.real_rows is None else logits[: inputs.real_rows]

    def forward_pooling(self, inputs: StepInputs) -> torch.Tensor:
        """The step eagerly, whatever `compile` says (a compiled graph would not run a hook added now), with
        the decoder's final hidden states handed to the pooling requests (`PoolingRows.reduce`)."""
        captured: list[torch.Tensor] = []

        def keep(_module, _args, output) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

        handle = self.model.get_decoder().register_forward_hook(keep)
        try:
            with small_step_linear(inputs.input_ids.shape[-1], self.device):
                logits = self.run_model(inputs.input_ids, inputs.position_ids, inputs.logits_indices, inputs.metadata,
                                        eager=True)
        finally:
            handle.remove()
        inputs.pooling.reduce(captured[-1][0])
        return logits

    def run_model(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor,
                  metadata: AttentionMetadata, eager: bool = False) -> torch.Tensor:
        """The packed forward `[1, T]` -> the logits rows `logits_indices`, inside a step context for `metadata`;
        `eager` runs the model itself even when a compiled forward exists."""
        extra = {}
        if self.single_row and not eager and input_ids.shape[-1] == 1:
            extra["paged_single_row"] = single_row_step(metadata, self.cache.kv)
        out = (self.model if eager else self.forward_model)(
            input_ids=input_ids,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            paged_cache=self.cache,
            logits_to_keep=logits_indices,
            **extra,
        )
        return out.logits[0]

    @property
    def compiled(self) -> bool:
        return self.forward_model is not self.model

    @property
    def single_row(self) -> bool:
        """Whether one-token steps attend inside the compiled graph (torch_single_row.py): compiled on CPU over
        a float cache. CUDA keeps its Triton kernel and an int8 cache the opaque op."""
        return self.compiled and self.device.type == "cpu" and self.cache.kv_scales is None

    def model_unchanged(self) -> bool:
        """Whether the compiled forward still fits the model (compilation.structure_of); always, when eager."""
        return not self.compiled or compilation.structure_of(self.model) == self.compiled_structure

    def compile(self) -> float:
        """Compile the model forward and warm it up on every shape class; return the seconds taken."""
        self.forward_model, self.compiled_structure = compilation.compile_model(self.model)
        return compilation.warm_up(self.warm_up_step, self.cache.kv, self.cache.block_size, self.cache.kv_scales,
                                   compilation.warm_up_shapes(self.model))

    def warm_up_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor,
                     metadata: AttentionMetadata) -> torch.Tensor:
        """run_model for a warm-up step, with the LoRA mask every compiled step has (no token on an adapter)."""
        step = None
        if self.lora_slots is not None:
            tokens = input_ids.shape[-1]
            step = self.lora_slots.prepare_step(np.zeros(1, dtype=np.int64), np.array([tokens]), self.device)
        with lora.step_context(step):
            return self.run_model(input_ids, position_ids, logits_indices, metadata)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        requests, counts = batch.requests, np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=len(requests))
        ends = starts + counts
        spec = np.fromiter((len(r.spec_token_ids) for r in requests), dtype=np.int64, count=len(requests))
        token_ids = np.concatenate(
            [np.asarray(r.token_slice(s, e - d) + r.spec_token_ids if d else r.token_slice(s, e), dtype=np.int64)
             for r, s, e, d in zip(requests, starts, ends, spec.tolist())]
        )
        positions, query_start_loc, metadata = self.pack(self.block_table_array(requests), starts, counts)
        sampling = [i for i, r in enumerate(requests) if ends[i] - spec[i] == r.num_tokens and r.pooling is None]
        logits_rows = self.sampling_rows(query_start_loc[1:][sampling] - 1, spec[sampling])
        spans, span_rows = self.prompt_spans(requests, starts, ends - spec, query_start_loc)
        if spans:
            logits_rows = np.concatenate([logits_rows, span_rows])
        elif not sampling:  # only partial prompt chunks: keep one row so the forward's shape is valid
            logits_rows = query_start_loc[-1:] - 1
        return StepInputs(
            input_ids=self.to_device(token_ids)[None],
            position_ids=self.to_device(positions)[None],
            logits_indices=self.to_device(logits_rows),
            sampling_requests=[requests[i] for i in sampling],
            metadata=metadata,
            prompt_spans=tuple(spans),
            lora=self.lora_step(requests, counts),
            pooling=pooling_rows(requests, starts, ends, query_start_loc, self.to_device),
        )

    def pack(self, block_tables: np.ndarray, starts: np.ndarray, counts: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
        """Positions, query offsets and attention metadata of a packed row where sequence i (block table row
        i) computes `counts[i]` tokens from position `starts[i]`."""
        ends = starts + counts
        query_start_loc = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        positions = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1] - starts, counts)
        block_size = self.cache.block_size
        rows = np.repeat(np.arange(len(starts)), counts)
        slots = block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        metadata = AttentionMetadata(
            slot_mapping=self.to_device(slots),
            block_tables=self.to_device(block_tables),
            query_start_loc=self.to_device(query_start_loc.astype(np.int32)),
            seq_lens=self.to_device(ends.astype(np.int32)),
            block_size=block_size,
            query_start_loc_host=query_start_loc.tolist(),
            seq_lens_host=ends.tolist(),
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
        )
        return positions, query_start_loc, metadata

    def lora_step(self, requests: list[Request], counts: np.ndarray) -> lora.LoRAStep | None:
        if self.lora_slots is None:
            return None
        slots = np.fromiter((r.lora_slot for r in requests), dtype=np.int64, count=len(requests))
        return self.lora_slots.prepare_step(slots, counts, self.device)

    @staticmethod
    def sampling_rows(last_rows: np.ndarray, num_spec: np.ndarray) -> np.ndarray:
        """The rows that sample: each request's last position, preceded by one per proposed token it
        carries (the position before each proposal predicts it), in request order."""
        if not num_spec.any():
            return last_rows
        counts = num_spec + 1
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(last_rows - num_spec, counts) + offsets

    @staticmethod
    def prompt_spans(requests: list[Request], starts: np.ndarray, ends: np.ndarray,
                     query_start_loc: np.ndarray) -> tuple[list[PromptSpan], np.ndarray]:
        """The prompt tokens this step can score, and the packed rows whose logits predict them."""
        spans, rows = [], []
        for i, request in enumerate(requests):
            if request.prompt_logprobs is None:
                continue
            first, count = wanted_targets(request, int(starts[i]), int(ends[i]))
            if count:
                spans.append(PromptSpan(request, first, count))
                # Target t is predicted by position t - 1, packed at query_start + (t - 1 - start).
                rows.append(query_start_loc[i] + first - 1 - starts[i] + np.arange(count))
        return spans, (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))

    @staticmethod
    def block_table_array(requests: list[Request]) -> np.ndarray:
        width = max(len(r.block_ids) for r in requests)
        table = np.zeros((len(requests), width), dtype=np.int32)
        for i, request in enumerate(requests):
            table[i, : len(request.block_ids)] = request.block_ids
        return table

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
