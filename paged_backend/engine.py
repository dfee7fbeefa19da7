"""Engine: add requests, step the continuous batch, collect outputs.

One step = schedule -> one packed model forward -> sample -> the scheduler takes in the result (tokens,
stops, grammars, freeing) -> the output processor makes the outputs. Requests join and leave the running
batch at every step. A bad request is refused with a ValueError at `add_request`; a failure inside a step
ends only the requests of that step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel

from paged_backend.config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_CUDA_KV_FRACTION,
    EngineConfig,
)
from paged_backend.core.kv_cache_groups import CacheGroups, plan_groups
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.outputs import RequestOutput
from paged_backend.core.pooling import PoolingParams, matryoshka_dimensions
from paged_backend.core.request import LogitsProcessor, Request, RequestStatus
from paged_backend.core.request_group import RequestGroup
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.step_result import RequestUpdate, StepResult
from paged_backend.input_processor import InputProcessor, Prompt
from paged_backend.model import compilation, cuda_graphs, fused_projections
from paged_backend.model.decode_padding import DecodePadding
from paged_backend.model.lora import LoRAAdapter, LoRARegistry, LoRASlots, LoRASpec
from paged_backend.model.fast_path_check import FastPathCheck, check_compiled
from paged_backend.model.model_check import prepare_model, temperature_tuning_limit, usable_context
from paged_backend.model.model_loader import check_architecture, eager_type_reason, model_object
from paged_backend.model.model_runner import ModelRunner, StepInputs
from paged_backend.model.model_state import ModelStates
from paged_backend.model.paged_cache import KVShape, PagedCache
from paged_backend.output_processor import OutputProcessor
from paged_backend.model.recurrent_state import hybrid_state
from paged_backend.parallel.step_protocol import agree_on_blocks
from paged_backend import tracing
from paged_backend.sampling import prompt_logprobs
from paged_backend.sampling.grammar_queue import GrammarQueue
from paged_backend.sampling.sampler import SamplerOutput, sample
from paged_backend.sampling.sampling_params import SamplingParams
from paged_backend.speculative.draft_proposer import DraftProposer, load_draft
from paged_backend.speculative.speculation import Speculator, speculation_stats

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Prompt", "StepObserver"]

GRAMMAR_WAIT_S = 0.05  # an idle engine with grammars compiling sleeps this long at most, instead of spinning


class StepObserver(Protocol):
    """Watches each step's model forward (a benchmark timing steps): called just before and just after
    `ModelRunner.execute`, on the engine's thread. Register with `engine.observers.append(observer)`."""

    def before_forward(self, batch: SchedulerOutput) -> None: ...

    def after_forward(self, batch: SchedulerOutput, logits: torch.Tensor) -> None: ...


def check_step_size(config: EngineConfig, text_config) -> None:
    """Refuse a step budget larger than the model runs exactly in one packed step (temperature_tuning_limit).
    A padded decode step holds at most max_num_seqs rows."""
    limit = temperature_tuning_limit(text_config)
    if limit is None:
        return
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(config, name) > limit[0]:
            raise ValueError(f"EngineConfig.{name}={getattr(config, name)}: {limit[1]}")


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer=None, config: EngineConfig | None = None,
                 publish_step: Callable[[StepInputs], None] | None = None) -> None:
        self.config = config or EngineConfig()
        model = model_object(model)
        check_architecture(model)
        text_config = model.config.get_text_config()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        # Switches the model to the paged attention (or its adapter), probes and self-checks it; a
        # refused model is left as it came.
        check_step_size(self.config, text_config)
        shape = prepare_model(model, text_config.num_hidden_layers, self.config.self_check, self.config.max_model_len)
        fused = fused_projections.fuse_for_engine(model, self.config.fuse_projections)
        # A hybrid model's recurrent layers keep a state per running request (recurrent_state.py); None otherwise.
        self.recurrent, state_slots = hybrid_state(model, self.config, compilation.eager_reason() is not None)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_states = ModelStates(model)  # the user may change the model between calls
        param = next(model.parameters())
        kv_dtype = self.config.resolve_kv_cache_dtype(param.dtype)
        spec = self.config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            # Under tensor parallelism the draft is whole (not sharded) on rank 0, which alone proposes: its
            # forwards have no collectives, and the other ranks see its proposals in the step inputs.
            draft = load_draft(spec.model, model, tokenizer, self.config.self_check)
        num_blocks = agree_on_blocks(self._choose_num_blocks(shape, kv_dtype, param.device, draft), param.device)
        self.graph_refusal = cuda_graphs.refusal(param.device, param.dtype, shape.head_dim,
                                                 compilation.eager_reason() is not None, self.config.enable_lora)
        pad = self._wants_padding(param.device)
        groups = self._cache_groups(shape, pad, draft)
        if groups.frees_blocks:  # pages of fewer layers, the same memory; one more: the null block
            num_blocks = groups.pages_for(num_blocks)
            self.cache = PagedCache(shape, num_blocks + 1, self.config.block_size, kv_dtype, param.device, groups,
                                    null_block=num_blocks)
        else:
            # A padded decode step's padding rows write to one block beyond those the block pool hands out.
            self.cache = PagedCache(shape, num_blocks + pad, self.config.block_size, kv_dtype, param.device, groups)
        if draft is not None:  # as many blocks: the draft reads and writes through the target's block tables
            draft.allocate(num_blocks + pad, self.config.block_size, kv_dtype, param.device,
                           self.config.max_num_batched_tokens)
        self.kv = KVCacheManager(num_blocks, self.config.block_size,
                                 self.config.enable_prefix_caching and self.recurrent is None,  # no state for a prefix
                                 self.cache.groups, self.config.max_num_batched_tokens, state_slots)
        self.context_note = ""  # why the context is shorter than the model's positions, when it is
        self.max_model_len = self._resolve_max_model_len(text_config, draft)
        self.speculator = Speculator(spec, draft) if spec is not None else None
        self.loras, lora_slots = self._enable_lora(model)
        self.scheduler = Scheduler(self.config, self.kv, self.speculator, lora_slots)
        self.runner = ModelRunner(model, self.cache, publish_step, lora_slots)
        self.runner.fused = fused
        self.runner.recurrent = self.recurrent
        if pad:
            self.runner.padding = self._make_padding(shape, scratch_block=num_blocks)
        self.compile_s: float | None = None  # seconds the compile and warm-up took, when compiled
        self.graphs_loaded: bool | None = None  # whether they came from the compile cache; None: not compiled
        self.compiled = self._maybe_compile(param.device)
        self.fast_path_check = self._check_fast_path()  # the compiled forward against the eager one, or None
        self.capture_s: float | None = None  # seconds the CUDA graph capture took, when captured
        self.captured = self._maybe_capture()
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = find_eos_ids(model, tokenizer)
        self.requests: dict[str, RequestGroup] = {}  # user's id -> its samples
        self.ids = itertools.count()
        self.hidden_size = text_config.hidden_size  # an embedding's size
        self.embedding_sizes = matryoshka_dimensions(model.config)  # sizes it may be truncated to, if any
        self.inputs = InputProcessor(tokenizer, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                     context_note=self.context_note, hidden_size=self.hidden_size,
                                     embedding_sizes=self.embedding_sizes, eos_token_ids=self.eos_token_ids,
                                     device=self.cache.kv.device)
        self.grammar_queue = GrammarQueue(self.vocab_size)  # structured requests wait here for their grammar
        self.output_processor = OutputProcessor()
        self.observers: list[StepObserver] = []  # see StepObserver

    def _cache_groups(self, shape: KVShape, pad: bool, draft: DraftProposer | None) -> CacheGroups:
        """The layer groups of the KV cache: per window, so window layers free their old blocks
        (kv_cache_groups.py), unless the model has no window or this engine needs one block table for all
        layers; then one group keeping every block, as a model without windows has."""
        # A hybrid model's recurrent layers (no_kv_layers) keep no K/V: the pages hold its attention layers only.
        groups = plan_groups(list(shape.layer_windows), shape.no_kv_layers)
        if not groups.frees_blocks:
            return groups
        reason = self._window_memory_refusal(pad, draft)
        if reason is not None:
            logger.info("sliding windows: every layer keeps every block (%s)", reason)
            return plan_groups([None] * shape.num_layers, shape.no_kv_layers)
        return groups

    def _window_memory_refusal(self, pad: bool, draft: DraftProposer | None) -> str | None:
        """Why this engine keeps every block of its window layers, or None when they free theirs. A compiled
        forward frees them too: its graphs read no block table (the attention op takes each layer's group
        metadata from the step context)."""
        if not self.config.free_window_blocks:
            return "EngineConfig.free_window_blocks=False"
        if draft is not None:
            return "a draft model reads and writes through the target's one block table"
        if compilation.eager_reason() is not None:
            return "tensor parallelism's ranks share one block table"
        if pad:
            return "padded and captured decode steps replay one block table"
        return None

    def _enable_lora(self, model: PreTrainedModel) -> tuple[LoRARegistry | None, LoRASlots | None]:
        config = self.config
        if not config.enable_lora:
            return None, None
        if compilation.eager_reason() is not None:
            raise ValueError("enable_lora=True does not run with tensor parallelism (the adapters' B matrices "
                             "would have to be sharded like the layers they adapt)")
        registry = LoRARegistry(model, config.max_lora_rank)
        return registry, LoRASlots(model, config.max_loras, config.max_lora_rank)

    def _maybe_compile(self, device: torch.device) -> bool:
        """Compile the runner's forward when the config asks (or, by default, on CUDA); say how long it took."""
        if not compilation.wants_compile(self.config.compile, device):
            return False
        reason = (compilation.eager_reason() or compilation.model_eager_reason(self.model)
                  or eager_type_reason(self.model))
        if reason is not None:
            logger.info("compile: %s", reason)
            return False
        if self.runner.lora_slots is not None:  # the graph holds every hook an adapter may need (lora.py)
            hooked = self.runner.lora_slots.hook_adaptable_linears()
            logger.info("compile: LoRA hooks on all %d adaptable linears", hooked)
        try:
            report = self.runner.compile()
        except Exception as exc:  # noqa: BLE001  (the engine still runs, eagerly)
            logger.warning("compile: the model forward failed to compile (%s: %s); it runs eagerly",
                           type(exc).__name__, next(iter(str(exc).strip().splitlines()), ""))
            return False
        self.compile_s, self.graphs_loaded = report.seconds, report.loaded
        source = "loaded from the compile cache" if report.loaded else "compiled"
        logger.info("compile: the model forward %s (%d graphs, %s) and warmed up in %.1f s", source,
                    len(report.forward.graphs), report.folder, report.seconds)
        return True

    def _check_fast_path(self) -> FastPathCheck | None:
        """With the self-check on, run the start-up probe through the compiled forward and the eager one
        (fast_path_check.py); a compiled forward whose distributions leave the bound is dropped, and the engine says
        so."""
        if not self.compiled or not self.config.self_check:
            return None
        check = check_compiled(self.runner)
        if check.passed:
            logger.info("compile: the compiled forward matches the eager one on the start-up probe (largest KL "
                        "divergence %.3g, bound %.3g, %.2f s)", check.worst, check.allowed, check.seconds)
            return check
        logger.warning("compile: the compiled forward's next-token distributions differ from the eager forward's by "
                       "a KL divergence of %.4g (bound %.4g) on the start-up probe, so the engine runs eagerly",
                       check.worst, check.allowed)
        self.runner.drop_compiled()
        self.compiled = False
        return check

    def _wants_padding(self, device: torch.device) -> bool:
        """Pad decode-only steps: where they are captured (CUDA), or anywhere when the config says so."""
        config = self.config
        if not config.cuda_graph_sizes or config.pad_decode is False:
            return False
        if self.recurrent is not None:  # padding rows would need state slots of their own
            return False
        if config.enable_lora:  # the LoRA hooks run per step (eagerly): a captured step would leave them out
            logger.info("CUDA graphs: LoRA steps run eagerly and unpadded")
            return False
        if device.type == "cuda" and self.graph_refusal is not None:
            logger.info("CUDA graphs: %s; decode steps run uncaptured", self.graph_refusal)
        return bool(config.pad_decode) or self.graph_refusal is None

    def _make_padding(self, shape: KVShape, scratch_block: int) -> DecodePadding:
        sizes = self.config.cuda_graph_sizes
        device = self.cache.kv.device
        segments = (cuda_graphs.segments_per_size(sizes, shape.num_kv_heads, self.max_model_len, device)
                    if self.graph_refusal is None else None)
        return DecodePadding(sizes, -(-self.max_model_len // self.config.block_size), scratch_block,
                             self.config.block_size, device, segments)

    def _maybe_capture(self) -> bool:
        """Capture the padded decode step of every size in a CUDA graph, when this engine can; say how long
        it took. A failed capture is logged and the engine runs uncaptured."""
        if self.runner.padding is None or self.graph_refusal is not None:
            return False
        graphs = cuda_graphs.DecodeGraphs(self.runner.padding, self.runner.run_model, self.cache.kv,
                                          self.cache.kv_scales)
        try:
            self.capture_s = graphs.capture()
        except Exception as exc:  # noqa: BLE001  (the engine still runs, uncaptured)
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run uncaptured", type(exc).__name__, exc)
            return False
        self.runner.graphs = graphs
        logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s",
                    self.config.cuda_graph_sizes, self.capture_s)
        return True

    def _choose_num_blocks(self, shape: KVShape, dtype: torch.dtype, device: torch.device,
                          draft: DraftProposer | None = None) -> int:
        """Blocks within the K/V budget; a draft model's cache has as many blocks and shares the budget."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_bytes
        if budget is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_CUDA_KV_FRACTION)
        budget = budget or DEFAULT_CPU_KV_BYTES
        per_block = shape.bytes_per_block(self.config.block_size, dtype)
        if draft is not None:
            per_block += draft.shape.bytes_per_block(self.config.block_size, dtype)
        return max(1, budget // per_block)

    def _resolve_max_model_len(self, text_config, draft: DraftProposer | None = None) -> int:
        model_len = self.config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 2048
        limit = usable_context(text_config)
        if limit is not None:
            if self.config.max_model_len is not None and self.config.max_model_len > limit[0]:
                raise ValueError(f"EngineConfig.max_model_len={self.config.max_model_len}: {limit[1]}")
            model_len = min(model_len, limit[0])
            self.context_note = f" ({limit[1]})"
        if draft is not None:  # the draft sees every position the target does
            model_len = min(model_len, getattr(draft.model.config.get_text_config(), "max_position_embeddings",
                                               None) or model_len)
        # A request alone must always fit in the cache, or preemption could never make room for it.
        return min(model_len, self.kv.capacity_tokens)

    @property
    def model_name(self) -> str:
        """The model's hub id, or its folder's name when loaded from disk (what traces call
        `gen_ai.request.model`); the class name when it has neither."""
        name = getattr(self.model, "name_or_path", "") or type(self.model).__name__
        return Path(name).name if Path(name).is_dir() else name

    @property
    def device(self) -> torch.device:
        """Where the model and its KV cache live."""
        return self.cache.kv.device

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = True,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        logits_processor: LogitsProcessor | None = None,
        prompt_token_ids: list[int] | None = None,
        lora: LoRASpec | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); raise ValueError, leaving the engine untouched, if it is invalid.

        With `params.n > 1` the prompt is sampled n times; the samples share its cached blocks. With
        `params.best_of > n` it is sampled best_of times and only the n samples with the best mean token
        logprob are returned, in one final output (which samples win is known only at the end).
        `logits_processor(output_token_ids, row)` maps this request's logits row `[V]` to the row it is
        sampled from (vLLM's form; every sample of an n > 1 request is passed its own output ids).
        `prompt_token_ids`, when the caller has already tokenized a text prompt, saves doing it twice.
        `lora` (an adapter name or a `LoRARequest`) runs the request with that adapter (see `add_lora`).
        `trace_headers`: the W3C trace context its span continues when tracing is on (tracing.py; default:
        the calling thread's current span)."""
        params = params or SamplingParams()
        request_id = self._new_request_id(request_id)
        text, token_ids = self.inputs.prompt_tokens(prompt, prompt_token_ids)
        self.inputs.validate(token_ids, params)
        adapter = self.resolve_lora(lora)
        group = self.inputs.make_group(request_id, text, token_ids, params, stream=stream, arrival_time=arrival_time,
                                       cache_salt=cache_salt, logits_processor=logits_processor, adapter=adapter,
                                       model_state=self.model_states.current())
        group.leader.metrics.timeline = tracing.start_timeline(trace_headers, self.model_name, params)
        for request in group.samples:
            self._enqueue(request)
        self.requests[request_id] = group
        return request_id

    def add_pooling_request(self, prompt: Prompt, pooling: PoolingParams | None = None, request_id: str | None = None,
                            prompt_token_ids: list[int] | None = None,
                            trace_headers: Mapping[str, str] | None = None) -> str:
        """Queue a prompt whose final hidden states become an embedding (core/pooling.py); its finished
        output carries it in `embedding`. ValueError, leaving the engine untouched, if it is invalid."""
        pooling = pooling or PoolingParams()
        request_id = self._new_request_id(request_id)
        text, token_ids = self.inputs.prompt_tokens(prompt, prompt_token_ids)
        self.inputs.validate_pooling(token_ids, pooling)
        request = self.inputs.make_pooling_request(request_id, text, token_ids, pooling, self.model_states.current())
        request.metrics.timeline = tracing.start_timeline(trace_headers, self.model_name, None, "embeddings")
        self.scheduler.add(request)
        self.requests[request_id] = request.group
        return request_id

    def abort_request(self, request_id: str, error: str | None = None) -> None:
        """Stop a request (all its samples) now and free its blocks; its final output comes from the next step()."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return
        for request in group.samples:
            if not request.is_finished:
                request.error = error
                self._finish(request, "abort")
        self.output_processor.add_final(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.output_processor.pending) or bool(self.grammar_queue)

    def enable_structured_outputs(self, tokenizer) -> None:
        """Constrain structured requests over this tokenizer's vocabulary (the engine's own by default;
        an engine built without one, as `generate`'s is, gets it from the call)."""
        self.grammar_queue.enable(tokenizer)
        self.inputs.can_constrain = True

    def _new_request_id(self, request_id: str | None) -> str:
        """`request_id`, or a fresh one when None; ValueError if a request already has it."""
        request_id = request_id if request_id is not None else str(next(self.ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def _enqueue(self, request: Request) -> None:
        """A structured request waits for its grammar outside the scheduler, so it holds up no one."""
        if request.params.structured_outputs is None:
            self.scheduler.add(request)
            return
        self.enable_structured_outputs(self.tokenizer)
        self.grammar_queue.add(request)

    def _finish(self, request: Request, reason: str) -> None:
        """End a request wherever it is: still waiting for its grammar, or in the scheduler."""
        if self.grammar_queue.remove(request):  # never reached the scheduler
            request.finish_reason = reason
            request.metrics.finished_time = time.time()
            request.status = RequestStatus.FINISHED
        else:
            self.scheduler.finish(request, reason)

    # ---------------------------------------------------------------- LoRA adapters

    def add_lora(self, name: str, source, adapter_name: str | None = None) -> None:
        """Register a LoRA adapter under `name` from a PEFT folder or a loaded PeftModel (its `adapter_name`,
        by default the active one); ValueError if it does not fit the base model or max_lora_rank.
        Safe from any thread: the engine loads it onto the device when a request first runs with it."""
        self._require_lora().add(name, source, adapter_name)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name`: new requests cannot ask for it; requests already queued with it finish."""
        self._require_lora().remove(name)

    def list_loras(self) -> list[str]:
        return self.loras.names() if self.loras is not None else []

    def resolve_lora(self, lora: LoRASpec | None) -> LoRAAdapter | None:
        """The adapter a request asks for (None: the base); ValueError for an unknown one."""
        return None if lora is None else self._require_lora().resolve(lora)

    def _require_lora(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        return self.loras

    # ---------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs that changed (every new token when streaming)."""
        outputs = self._step()
        tracing.end_spans(outputs)
        return outputs

    def _step(self) -> list[RequestOutput]:
        self._admit_compiled()
        outputs = self.output_processor.take_pending()
        batch = self.scheduler.schedule()
        if not batch.requests:
            self.grammar_queue.wait(GRAMMAR_WAIT_S)  # nothing else to run: sleep until a grammar is ready
            return outputs
        started = time.time()
        try:
            result = self._run(batch)
        except Exception as exc:  # noqa: BLE001  (a failed forward ends its step's requests, not the engine)
            return outputs + self._fail(batch, exc)
        tracing.record_chunks(batch, started, time.time())
        updates = self.scheduler.update_from_output(batch, result)
        outputs += self.output_processor.process(updates, result.sampled)
        self._forget_finished(updates)
        return outputs

    def _admit_compiled(self) -> None:
        """Hand requests whose grammar is ready to the scheduler; a grammar that failed ends its request."""
        for request, error in self.grammar_queue.ready():
            if error is None:
                if request.metrics.timeline is not None:
                    request.metrics.timeline.grammar_ready = time.time()
                self.scheduler.add(request)
            else:
                self.abort_request(request.group.request_id, error)

    def _run(self, batch: SchedulerOutput) -> StepResult:
        """Draft (with a draft model), run the step's forward, sample, and score prompts that asked for it."""
        with torch.inference_mode():
            if batch.drafts:
                self.speculator.make_drafts(batch)
            for observer in self.observers:
                observer.before_forward(batch)
            logits, inputs = self.runner.execute(batch)
            for observer in self.observers:
                observer.after_forward(batch, logits)
            requests = inputs.sampling_requests
            sampled, kept, rows = self._sample_tokens(logits, requests)
            prompt_logprobs.record(logits[len(sampled.token_ids):], inputs.prompt_spans)
        pooled = inputs.pooling.requests if inputs.pooling is not None else []
        return StepResult(sampled, requests, kept, rows, pooled)

    def _fail(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """End every request of a step whose forward failed (their proposals dropped); their final outputs."""
        logger.exception("engine step failed")
        for request in batch.requests:
            request.spec_token_ids = []
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.cancel()
        for request_id in dict.fromkeys(r.group.request_id for r in batch.requests):
            self.abort_request(request_id, error=f"{type(exc).__name__}: {exc}")
        return self.output_processor.take_pending()

    def _forget_finished(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            if update.group_finished:
                self.requests.pop(update.request.group.request_id, None)

    def _sample_tokens(self, logits: torch.Tensor, requests: list[Request]
                ) -> tuple[SamplerOutput, list[list[int]], list[int]]:
        """Sample the step's new tokens: per request, the tokens it keeps and the sampler row of the first."""
        if self.speculator is None or not any(r.spec_token_ids for r in requests):
            sampled = sample(logits[: len(requests)], requests, self.grammar_queue.fill_bitmask(requests))
            return sampled, [[token] for token in sampled.token_ids], list(range(len(requests)))
        # Constrained requests carry no proposals (see Scheduler.add_proposals): one row each, as the mask has.
        row_requests, extras = Speculator.expand_rows(requests)
        states = [Speculator.save_generator(r) for r in requests]
        sampled = sample(logits[: len(row_requests)], row_requests, self.grammar_queue.fill_bitmask(row_requests),
                         extras, Speculator.draft_rows(requests))
        kept, rows, row = [], [], 0
        for request, state in zip(requests, states):
            num_rows = len(request.spec_token_ids) + 1
            tokens = self.speculator.accept(request, sampled.token_ids[row : row + num_rows])
            if state is not None:
                Speculator.rewind_generator(request, state, len(tokens), logits.shape[-1])
            kept.append(tokens)
            rows.append(row)
            row += num_rows
        return sampled, kept, rows

    # ---------------------------------------------------------------- stats

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes when no request holds blocks (else nothing changes); returns whether
        it did."""
        return self.kv.pool.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        samples = self.scheduler.utilisation_samples
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.kv.pool.num_blocks,
            "kv_blocks_free": self.kv.pool.num_free,
            "kv_usage": self.kv.pool.usage,
            "kv_utilisation_mean": sum(samples) / len(samples) if samples else 1.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate,
            "prefix_cache_hit_tokens": self.kv.hit_tokens,
            "prefix_cache_queried_tokens": self.kv.queried_tokens,  # to combine hit rates across engines
            "num_computed_tokens": self.scheduler.num_computed_tokens,
            **group_stats(self.kv),
            **self._recurrent_stats(),
            **(self.speculator.stats() if self.speculator else speculation_stats(0, 0, 0)),
            **(self.fast_path_check.stats() if self.fast_path_check else {}),
            **self.grammar_queue.stats(),
            **self._startup_stats(),
        }

    def _startup_stats(self) -> dict[str, float]:
        """How the compiled forward came to be at start-up: its seconds (compile or load, and warm-up) and
        whether its graphs were loaded from the compile cache (1) or compiled (0); nothing when eager."""
        if self.graphs_loaded is None:
            return {}
        return {"startup_compile_seconds": self.compile_s, "startup_graphs_loaded": float(self.graphs_loaded)}

    def _recurrent_stats(self) -> dict[str, float]:
        """A hybrid model's state slots (prefix caching is off for it: prefix_caching_enabled 0)."""
        if self.recurrent is None:
            return {}
        slots = self.kv.state_slots
        return {"prefix_caching_enabled": 0, "recurrent_slots_total": slots.num_slots,
                "recurrent_slots_free": slots.num_free, "recurrent_state_bytes": self.recurrent.nbytes}


def group_stats(kv: KVCacheManager) -> dict[str, float]:
    """Blocks in use and the window of each layer group, when window layers free their blocks (a model
    without windows has one group: kv_blocks_total - kv_blocks_free)."""
    groups = kv.groups
    if not groups.frees_blocks:
        return {}
    stats: dict[str, float] = {"kv_num_groups": groups.num_groups}
    for g, (group, used) in enumerate(zip(groups.groups, kv.blocks_per_group())):
        stats[f"kv_group_{g}_blocks"] = used
        stats[f"kv_group_{g}_window"] = group.window or 0  # 0: full attention
        stats[f"kv_group_{g}_layers"] = len(group.layers)
    return stats


def find_eos_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None) if gen_eos is None else None,
                  getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
