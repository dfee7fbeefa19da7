"""ModelRunner: turns a scheduled batch into one packed forward of the unmodified HF model.

Inputs are built with numpy over the whole batch (no Python work per token): the new tokens of
every request are packed into one row `[1, T]` with their positions, cache slots, block tables and
query offsets, and logits are computed only at the last position of requests that sample (and at
the positions of the proposed tokens a request carries, which speculation verifies).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from paged_backend.core.pooling import pooling_rows
from paged_backend.core.request import Request
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.kernels import AttentionMetadata, pack_sequences, to_device
from paged_backend.kernels.torch_single_row import single_row_step
from paged_backend.model import batch_invariant, lora
from paged_backend.model.compiled import compilation, layer_regions
from paged_backend.model.quantized import fused_projections
from paged_backend.model.compiled.cuda_graphs import DecodeGraphs
from paged_backend.model.compiled.decode_padding import DecodePadding
from paged_backend.model.paged.paged_cache import PagedCache
from paged_backend.model.paged.recurrent_state import RecurrentState, RecurrentStep
from paged_backend.model.quantized.small_step_linear import small_step_linear
from paged_backend.model.paged.step_context import LoRAStep, StepContext, step_context
from paged_backend.model.step_inputs import StepInputs
from paged_backend.model.vision.step_images import StepImages
from paged_backend.sampling.prompt_logprobs import PromptSpan, wanted_targets

class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedCache,
                 publish: Callable[[StepInputs], None] | None = None, lora_slots: lora.LoRASlots | None = None,
                 fused: bool = False, recurrent: RecurrentState | None = None) -> None:
        self.model = model
        self.lora_slots = lora_slots
        # What runs the step and returns its logits: the model eagerly, or its compiled graphs (compile()).
        self.forward_model: Callable[..., torch.Tensor] = partial(compilation.logits_of, model)
        self.cache = cache
        self.device = cache.kv.device
        self.publish = publish  # tensor parallelism: hands each step's inputs to the other ranks
        self.padding: DecodePadding | None = None  # pads decode-only steps, when the start-up plan asks (runner_start.py)
        self.graphs: DecodeGraphs | None = None  # replays padded decode steps on CUDA, once captured
        self.compiled_structure: tuple | None = None  # the model's structure its forward was compiled for
        self.fused = fused  # steps run the model's projections fused (fused_projections.py)
        self.recurrent = recurrent  # a hybrid model's recurrent-layer state, when it has one
        self.invariant_rows: int | None = None  # batch-invariant steps: the rows every F.linear is padded to
        self.invariant_attention: tuple | None = None  # and each layer's attention record, marked batch-invariant
        self.images: StepImages | None = None  # a vision-language model's image rows (step_images.py)

    def make_batch_invariant(self, min_rows: int) -> None:
        """Run every step batch-invariantly (batch_invariant.py): each `F.linear` on at least `min_rows` rows and every
        query row through the CPU attention kernel."""
        self.invariant_rows = min_rows
        self.invariant_attention = tuple(None if record is None else dataclasses.replace(record, batch_invariant=True)
                                         for record in self.cache.shape.attention)

    def linear_rows(self, tokens: int) -> contextlib.AbstractContextManager:
        """How a step of `tokens` rows runs its linears: padded in a batch-invariant engine, else transposed at a
        few rows on CPU (small_step_linear.py) or untouched."""
        if self.invariant_rows is not None:
            return batch_invariant.padded_rows(self.invariant_rows)
        return small_step_linear(tokens, self.device)

    def execute(self, batch: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """Run one forward; return the kept logits and the step's inputs: the first rows are those of
        `inputs.sampling_requests` (the requests that reach their last token; 1 + its proposals for a request
        carrying proposed tokens), then those of `inputs.prompt_spans`.
        The caller holds `torch.inference_mode()` over this and the sampling that follows."""
        inputs = self.prepare_inputs(batch)
        # A step with pooling requests runs unpadded and eagerly (_forward_pooling): a captured graph has no hook;
        # so does a step with image rows, whose graph would take token ids.
        padded = (self.padding is not None and inputs.pooling is None and inputs.inputs_embeds is None
                  and inputs.position_ids.dim() == 2)  # multi-axis positions are not padded
        size = self.padding.size_for(inputs) if padded else None
        if size is not None:  # before publishing: every tensor-parallel rank runs the same padded step
            inputs = self.padding.pad(inputs, size)
        if self.publish is not None:
            self.publish(inputs)
        return self.forward(inputs), inputs

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        with step_context(self._context(inputs.metadata, inputs.group_metadata, inputs.lora, inputs.recurrent)):
            if inputs.pooling is not None:
                return self._forward_pooling(inputs)
            if inputs.inputs_embeds is not None:
                with self.linear_rows(inputs.input_ids.shape[-1]):
                    return self.run_model(inputs.input_ids, inputs.position_ids, inputs.logits_indices,
                                          inputs.metadata, eager=True, inputs_embeds=inputs.inputs_embeds)
            logits = self.graphs.replay(inputs) if self.graphs is not None and inputs.real_rows is not None else None
            if logits is None:
                # Eager only: the compiled forward has its own matmul choices.
                tokens = inputs.input_ids.shape[-1] if not self.compiled else 0
                with self.linear_rows(tokens):
                    logits = self.run_model(inputs.input_ids, inputs.position_ids, inputs.logits_indices,
                                            inputs.metadata)
        return logits if inputs.real_rows is None else logits[: inputs.real_rows]

    def _forward_pooling(self, inputs: StepInputs) -> torch.Tensor:
        """The step eagerly, whatever `compile` says (a compiled graph would not run a hook added now), with
        the decoder's final hidden states handed to the pooling requests (`PoolingRows.reduce`)."""
        captured: list[torch.Tensor] = []

        def keep(_module, _args, output) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

        handle = self.model.get_decoder().register_forward_hook(keep)
        try:
            with self.linear_rows(inputs.input_ids.shape[-1]):
                logits = self.run_model(inputs.input_ids, inputs.position_ids, inputs.logits_indices, inputs.metadata,
                                        eager=True, inputs_embeds=inputs.inputs_embeds)
        finally:
            handle.remove()
        inputs.pooling.reduce(captured[-1][0])
        return logits

    def run_model(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor,
                  metadata: AttentionMetadata, eager: bool = False, inputs_embeds: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The packed forward `[1, T]` -> the logits rows `logits_indices`, inside a step context for `metadata`;
        `eager` runs the model itself even when a compiled forward exists; `inputs_embeds` (a step with image rows,
        eager) replace the token ids."""
        extra: dict = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        if self.single_row and not eager and input_ids.shape[-1] == 1:
            extra["paged_single_row"] = single_row_step(metadata, self.cache.kv)
        forward = partial(compilation.logits_of, self.model) if eager else self.forward_model
        logits = forward(
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            paged_cache=self.cache,
            logits_to_keep=logits_indices,
            **extra,
        )
        return logits[0]

    def run_in_context(self, inputs: StepInputs) -> torch.Tensor:
        """run_model for `inputs` inside their step context: no padding, no graph replay (what a CUDA graph
        captures)."""
        with step_context(self._context(inputs.metadata, lora_step=inputs.lora)):
            return self.run_model(inputs.input_ids, inputs.position_ids, inputs.logits_indices, inputs.metadata)

    def _context(self, metadata: AttentionMetadata, group_metadata: tuple[AttentionMetadata, ...] | None = None,
                 lora_step: LoRAStep | None = None, recurrent_step: RecurrentStep | None = None) -> StepContext:
        """What the step's layers read (step_context.py): its metadata over this runner's cache (with each layer
        group's, when given), its adapters, its recurrent state, whether projections run fused, and each layer's
        attention record (the cache's KVShape holds the probe's)."""
        groups = self.cache.groups if group_metadata is not None else None
        return StepContext(metadata, self.cache.kv, self.cache.kv_scales, group_metadata, groups, lora_step,
                           self.recurrent, recurrent_step, self.fused,
                           self.invariant_attention or self.cache.shape.attention)

    @property
    def compiled(self) -> bool:
        return isinstance(self.forward_model, compilation.CompiledForward)

    @property
    def single_row(self) -> bool:
        """Whether one-token steps attend inside the compiled graph (torch_single_row.py): compiled on CPU over
        a float cache of one block table. CUDA keeps its Triton kernel, an int8 cache the opaque op, and so does a
        cache of layer groups (the traced path reads every layer through one table, not its group's)."""
        return self.compiled and self.device.type == "cpu" and self.cache.kv_scales is None and not self.cache.grouped

    def model_unchanged(self) -> bool:
        """Whether the compiled forward still fits the model (compilation.structure_of; always, when eager) and
        its fused projections still compute the model's own weights (not replaced since)."""
        if self.fused and not fused_projections.fusion_intact(self.model):
            return False
        return not self.compiled or compilation.structure_of(self.model) == self.compiled_structure

    def compile(self) -> compilation.CompileReport:
        """Compile the model forward (or load its graphs from the compile cache) and warm it up on every shape
        class; say where the graphs came from and how long it took. On failure the runner stays eager."""
        cache, shapes = self.cache, compilation.warm_up_shapes(self.model)
        # A cache of layer groups traces its one-token graph without the single-row path (see single_row), and
        # may have the kv shape of one without groups (a model whose every layer slides alike), so the key's
        # single_row says it; otherwise grouping changes no graph (the op reads the groups from the step context).
        settings = {"shapes": shapes, "kv": [list(cache.kv.shape[:3]), cache.kv.shape[4], str(cache.kv.dtype)],
                    "kv_scales": cache.kv_scales is not None, "block_size": cache.block_size,
                    "single_row": self.device.type == "cpu" and cache.kv_scales is None and not cache.grouped,
                    "fused_projections": len(fused_projections.groups_of(self.model)) if self.fused else 0}

        def warm(forward: compilation.CompiledForward, title: str) -> float:
            self.forward_model = forward
            return compilation.warm_up(self._warm_up_step, cache, shapes, progress=title)

        layer_regions.index_layers(self.model)  # before a graph is traced or loaded: each reads the index tensors
        try:
            report = compilation.compile_forward(self.model, cache.kv, settings, warm)
        except BaseException:
            self.drop_compiled()  # a failed compile leaves the runner eager
            raise
        self.compiled_structure = compilation.structure_of(self.model)
        return report

    def drop_compiled(self) -> None:
        """Run the model eagerly from now on (a compiled forward that failed, or failed its check)."""
        self.forward_model = partial(compilation.logits_of, self.model)
        self.compiled_structure = None

    def _warm_up_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor,
                     metadata: AttentionMetadata) -> torch.Tensor:
        """run_model for a warm-up step in its step context, with the LoRA mask every compiled step has (no token on
        an adapter) and the metadata for every layer group."""
        step = None
        if self.lora_slots is not None:
            tokens = input_ids.shape[-1]
            step = self.lora_slots.prepare_step(np.zeros(1, dtype=np.int64), np.array([tokens]), self.device)
        group_metadata = (metadata,) * self.cache.groups.num_groups if self.cache.grouped else None
        with step_context(self._context(metadata, group_metadata, step)):
            return self.run_model(input_ids, position_ids, logits_indices, metadata)

    def prepare_inputs(self, batch: SchedulerOutput) -> StepInputs:
        requests, counts = batch.requests, np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=len(requests))
        ends = starts + counts
        spec = np.fromiter((len(r.spec_token_ids) for r in requests), dtype=np.int64, count=len(requests))
        token_ids = np.concatenate(
            [np.asarray(r.token_slice(s, e - d) + r.spec_token_ids if d else r.token_slice(s, e), dtype=np.int64)
             for r, s, e, d in zip(requests, starts, ends, spec.tolist())]
        )
        tables = self.block_table_array(requests)
        positions, query_start_loc, metadata = pack_sequences(tables, starts, counts, self.cache.block_size,
                                                               self.device)
        if self.images is not None:  # images whose tokens attend both ways (Gemma 3)
            metadata = self.images.widen(metadata, requests, starts, ends)
        sampling = [i for i, r in enumerate(requests) if ends[i] - spec[i] == r.num_tokens and r.pooling is None]
        logits_rows = self._sampling_rows(query_start_loc[1:][sampling] - 1, spec[sampling])
        spans, span_rows = self._prompt_spans(requests, starts, ends - spec, query_start_loc)
        if spans:
            logits_rows = np.concatenate([logits_rows, span_rows])
        elif not sampling:  # only partial prompt chunks: keep one row so the forward's shape is valid
            logits_rows = query_start_loc[-1:] - 1
        input_ids = self.to_device(token_ids)[None]
        if self.images is not None and self.images.family.multi_axis_positions:
            position_ids = self.to_device(self.images.rope_positions(requests, starts, counts, positions,
                                                                     query_start_loc))[:, None]
        else:
            position_ids = self.to_device(positions)[None]
        return StepInputs(
            input_ids=input_ids,
            position_ids=position_ids,
            logits_indices=self.to_device(logits_rows),
            sampling_requests=[requests[i] for i in sampling],
            metadata=metadata,
            prompt_spans=tuple(spans),
            lora=self._lora_step(requests, counts),
            group_metadata=(self._group_metadata(requests, tables, positions, starts, counts, metadata)
                            if self.cache.grouped else None),
            pooling=pooling_rows(requests, starts, ends, query_start_loc, self.to_device),
            recurrent=self._recurrent_step(requests, starts, query_start_loc),
            inputs_embeds=(self.images.input_embeds(requests, starts, ends, query_start_loc, input_ids)
                           if self.images is not None else None),
        )

    def _recurrent_step(self, requests: list[Request], starts: np.ndarray, query_start_loc: np.ndarray
                       ) -> RecurrentStep | None:
        """A hybrid model's step: where each request's tokens sit, what it had computed, and its state slot."""
        if self.recurrent is None:
            return None
        return RecurrentStep(tuple(query_start_loc.tolist()), tuple(starts.tolist()),
                             tuple(r.state_slot for r in requests))

    def _group_metadata(self, requests: list[Request], first_tables: np.ndarray, positions: np.ndarray,
                       starts: np.ndarray, counts: np.ndarray, first: AttentionMetadata) -> tuple[AttentionMetadata, ...]:
        """Each layer group's metadata. `first` (from pack(), over `first_tables`) is the first group's; the
        others differ in their block tables and the slots these give the step's tokens. The sequences of a group that
        frees blocks start at the first block its spec lets the step's first query view (_cropped_view): the
        kernels then read about what the group's layers attend to, not the whole sequence."""
        block_size = self.cache.block_size
        rows = np.repeat(np.arange(len(requests)), counts)
        metadata = []
        for index, group in enumerate(self.cache.groups.groups):
            if index == 0:
                tables, slot_mapping = first_tables, first.slot_mapping
            else:
                tables = self.block_table_array(requests, index)
                slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
                slot_mapping = self.to_device(slots)
            if not group.spec.frees_blocks:
                step = first if index == 0 else dataclasses.replace(
                    first, slot_mapping=slot_mapping, block_tables=self.to_device(tables), derived={})
            else:
                skip = np.fromiter((group.spec.first_viewed_block(start, block_size) for start in starts.tolist()),
                                   dtype=np.int64, count=len(starts))
                step = self._cropped_view(first, tables, slot_mapping, starts, counts, skip)
            metadata.append(step)
        return tuple(metadata)

    def _cropped_view(self, first: AttentionMetadata, tables: np.ndarray, slot_mapping: torch.Tensor,
                      starts: np.ndarray, counts: np.ndarray, skip: np.ndarray) -> AttentionMetadata:
        """The metadata of a group that frees blocks: sequence i cropped to start at its block `skip[i]`, the first
        its spec lets the step's first query view (LayerSpec.first_viewed_block). Causal and window masks (and
        ALiBi) depend only on the distance between query and key, and a chunk mask on the position within a chunk,
        which a crop by whole chunks keeps, so dropping those blocks from the front of a sequence, its length with
        them, changes nothing the queries see; slots stay absolute. A window group holds every entry from there
        on (it frees only blocks wholly before it), so the kernels never read the null block; a chunked group's
        view may start at freed entries before its chunk, which the chunk mask hides. A window layer's attention
        reads about its window, not the whole sequence."""
        block_size = self.cache.block_size
        ends = starts + counts
        width = max(1, int((tables.shape[1] - skip).max()))
        columns = np.minimum(skip[:, None] + np.arange(width), tables.shape[1] - 1)
        cropped = np.take_along_axis(tables, columns, axis=1)  # past a row's own blocks: padding, never read
        seq_lens = ends - skip * block_size
        return dataclasses.replace(
            first, slot_mapping=slot_mapping, block_tables=self.to_device(cropped),
            seq_lens=self.to_device(seq_lens.astype(np.int32)), seq_lens_host=seq_lens.tolist(),
            max_seq_len=int(seq_lens.max()), derived={})

    def _lora_step(self, requests: list[Request], counts: np.ndarray) -> LoRAStep | None:
        if self.lora_slots is None:
            return None
        slots = np.fromiter((r.lora_slot for r in requests), dtype=np.int64, count=len(requests))
        return self.lora_slots.prepare_step(slots, counts, self.device)

    @staticmethod
    def _sampling_rows(last_rows: np.ndarray, num_spec: np.ndarray) -> np.ndarray:
        """The rows that sample: each request's last position, preceded by one per proposed token it
        carries (the position before each proposal predicts it), in request order."""
        if not num_spec.any():
            return last_rows
        counts = num_spec + 1
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(last_rows - num_spec, counts) + offsets

    @staticmethod
    def _prompt_spans(requests: list[Request], starts: np.ndarray, ends: np.ndarray,
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
    def block_table_array(requests: list[Request], group: int = 0) -> np.ndarray:
        """The requests' block tables of layer group `group`, one row each, padded with 0."""
        width = max(len(r.block_tables[group]) for r in requests)
        table = np.zeros((len(requests), width), dtype=np.int32)
        for i, request in enumerate(requests):
            ids = request.block_tables[group]
            table[i, : len(ids)] = ids
        return table

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
