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

from paged_backend.config import EngineConfig
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.outputs import RequestOutput
from paged_backend.core.pooling import PoolingParams, matryoshka_dimensions
from paged_backend.core.request import LogitsProcessor, Request, RequestStatus
from paged_backend.core.request_group import RequestGroup
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.step_result import RequestUpdate, StepResult
from paged_backend.image_prompts import ImagePrompts, text_tokenizer
from paged_backend.input_processor import InputProcessor, Prompt
from paged_backend.kv_offload.offloader import make_offloader
from paged_backend.model.quantized import fused_projections
from paged_backend.model.lora import LoRAAdapter, LoRARegistry, LoRASlots, LoRASpec
from paged_backend.model.loading.model_check import prepare_model, temperature_tuning_limit
from paged_backend.model.loading.model_loader import check_architecture, model_object
from paged_backend.model.model_runner import ModelRunner
from paged_backend.model.loading.model_state import ModelStates
from paged_backend.model.paged.paged_cache import KVShape, PagedCache
from paged_backend.model.paged.recurrent_state import hybrid_state
from paged_backend.model.runner_start import start_runner
from paged_backend.model.step_inputs import StepInputs
from paged_backend.model.vision.families import family_of
from paged_backend.model.vision.step_images import StepImages
from paged_backend.output_processor import OutputProcessor
from paged_backend import tracing
from paged_backend.sampling.grammar_queue import GrammarQueue
from paged_backend.sampling.sampling_params import SamplingParams
from paged_backend.speculative.draft_proposer import DraftProposer, load_draft
from paged_backend.speculative.speculation import Speculator, speculation_stats
from paged_backend.step_sampler import StepSampler
from paged_backend.startup_plan import StartupPlan, fusion_off, plan_startup, read_facts, refuse_step_budget

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Prompt", "StepObserver"]

GRAMMAR_WAIT_S = 0.05  # an idle engine with grammars compiling sleeps this long at most, instead of spinning


class StepObserver(Protocol):
    """Watches each step's model forward (a benchmark timing steps): called just before and just after
    `ModelRunner.execute`, on the engine's thread. Register with `engine.observers.append(observer)`."""

    def before_forward(self, batch: SchedulerOutput) -> None: ...

    def after_forward(self, batch: SchedulerOutput, logits: torch.Tensor) -> None: ...


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer=None, config: EngineConfig | None = None,
                 publish_step: Callable[[StepInputs], None] | None = None) -> None:
        self.config = config = config or EngineConfig()
        model, (tokenizer, processor) = model_object(model), text_tokenizer(tokenizer)
        with caller_autocast_off(model):
            model, shape, fused, draft = prepare(model, tokenizer, config)
            self.plan = plan = plan_startup(config, read_facts(model, shape, draft))
            for topic, why in plan.notes:
                logger.info("%s: %s", topic, why)
            self.recurrent, state_slots = hybrid_state(model, config, plan.tensor_parallel)
            self.model, self.tokenizer, self.max_model_len = model.eval(), tokenizer, plan.max_model_len
            self.model_states = ModelStates(model)  # the user may change the model between calls
            self.cache = allocate_pages(shape, plan, config, draft)
            self.kv = KVCacheManager(plan.num_blocks, config.block_size, plan.prefix_caching, plan.groups,
                                     config.max_num_batched_tokens, state_slots)
            spec = config.speculative_config
            self.speculator = Speculator(spec, draft) if spec is not None else None
            self.loras, lora_slots = enable_lora(model, config)
            self.scheduler = Scheduler(config, self.kv, self.speculator, lora_slots)
            self.runner = ModelRunner(model, self.cache, publish_step, lora_slots, fused, self.recurrent)
            self.runner_start = start_runner(self.runner, plan, config)
            # Fingerprinted after start-up, so the state the tier serves is the one requests will be made under.
            self.kv.offload = make_offloader(config, model, shape, plan.groups, self.cache, self.model_states.current())
            self.requests: dict[str, RequestGroup] = {}  # user's id -> its samples
            self.ids = itertools.count()
            self._make_front_end(model.config, processor)

    def _make_front_end(self, model_config, processor) -> None:
        """What requests meet before and after the scheduler and the forward: the input checks (and images, with
        `processor` when the model takes them), the grammar queue, the step's sampler, the outputs."""
        model = self.model
        family = family_of(model_config) if not self.plan.tensor_parallel else None
        self.runner.images = StepImages(model, family) if family is not None else None
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = find_eos_ids(model, self.tokenizer)
        self.hidden_size = model_config.get_text_config().hidden_size  # an embedding's size
        self.embedding_sizes = matryoshka_dimensions(model_config)  # sizes it may be truncated to, if any
        self.inputs = InputProcessor(self.tokenizer, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                     context_note=self.plan.context_note, hidden_size=self.hidden_size,
                                     embedding_sizes=self.embedding_sizes, eos_token_ids=self.eos_token_ids,
                                     device=self.cache.kv.device,
                                     images=ImagePrompts(processor, model, self.model_name, family,
                                                         self.config.max_num_batched_tokens,
                                                         self.config.allowed_image_domains or ()))
        self.grammar_queue = GrammarQueue(self.vocab_size)  # structured requests wait here for their grammar
        self.sampler = StepSampler(self.grammar_queue, self.speculator)
        self.output_processor = OutputProcessor()
        self.observers: list[StepObserver] = []  # see StepObserver

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
        text, token_ids, visual = self.inputs.prompt_tokens(prompt, prompt_token_ids)
        self.inputs.validate(token_ids, params, visual.images if visual is not None else ())
        adapter = self.resolve_lora(lora)
        group = self.inputs.make_group(request_id, text, token_ids, params, stream=stream, arrival_time=arrival_time,
                                       cache_salt=cache_salt, logits_processor=logits_processor, adapter=adapter,
                                       model_state=self.model_states.current(), visual=visual)
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
        text, token_ids, visual = self.inputs.prompt_tokens(prompt, prompt_token_ids)
        if visual is not None and visual.images:
            raise ValueError("an embedding request takes text or token ids, not images")
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
        """Draft (with a draft model), run the step's forward, and sample it (step_sampler.py)."""
        with torch.inference_mode():
            if batch.drafts:
                self.speculator.make_drafts(batch)
            for observer in self.observers:
                observer.before_forward(batch)
            logits, inputs = self.runner.execute(batch)
            for observer in self.observers:
                observer.after_forward(batch, logits)
            return self.sampler.sample(logits, inputs)

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

    # ---------------------------------------------------------------- stats

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached prefixes when no request holds blocks (else nothing changes); returns whether
        it did. A second tier keeps its blocks: the disk tier is there to outlive resets and restarts."""
        return self.kv.pool.reset_prefix_cache()

    def flush_offload(self) -> None:
        """Wait until the second tier has stored every block given to it (no-op without one): before a restart
        whose requests should find them. Queued blocks are written at interpreter exit too."""
        if self.kv.offload is not None:
            self.kv.offload.flush()

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
            **self.grammar_queue.stats(),
            **self.runner_start.stats(),
            **self.plan.stats(),
            **(self.kv.offload.stats() if self.kv.offload is not None else {}),
            **(self.runner.images.cache.stats.as_dict() if self.runner.images is not None else {}),
        }

    def _recurrent_stats(self) -> dict[str, float]:
        """A hybrid model's state slots (prefix caching is off for it: prefix_caching_enabled 0)."""
        if self.recurrent is None:
            return {}
        slots = self.kv.state_slots
        return {"prefix_caching_enabled": 0, "recurrent_slots_total": slots.num_slots,
                "recurrent_slots_free": slots.num_free, "recurrent_state_bytes": self.recurrent.nbytes}


def caller_autocast_off(model: PreTrainedModel) -> torch.autocast:
    """Start-up runs outside the caller's autocast (a trainer's, TRL's, which builds the engine inside its first
    `generate`): the probe and the self-check compare the model's paged and dense forwards in its own dtype, and
    the compiled graphs are traced for it. The steps run in the caller's context, as HF `generate` would."""
    return torch.autocast(device_type=next(model.parameters()).device.type, enabled=False)


def group_stats(kv: KVCacheManager) -> dict[str, float]:
    """Blocks in use and the window (or chunk) of each layer group, when window or chunked layers free their blocks
    (a model without either has one group: kv_blocks_total - kv_blocks_free)."""
    groups = kv.groups
    if not groups.frees_blocks:
        return {}
    stats: dict[str, float] = {"kv_num_groups": groups.num_groups}
    for g, (group, used) in enumerate(zip(groups.groups, kv.blocks_per_group())):
        stats[f"kv_group_{g}_blocks"] = used
        stats[f"kv_group_{g}_window"] = group.spec.reach or 0  # the most keys a query reads; 0: all
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


def prepare(model: PreTrainedModel, tokenizer, config: EngineConfig
            ) -> tuple[PreTrainedModel, KVShape, bool, DraftProposer | None]:
    """Make `model` the engine's: refuse what it cannot run, switch it to the paged attention (or its adapter),
    probe and self-check it (a refused model is left as it came), fuse its projections, and load the draft model
    when the config speculates with one (on `config.num_threads` threads, when set). The model, its K/V shape, whether
    projections were fused, the draft."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    check_architecture(model)
    text_config = model.config.get_text_config()
    refuse_step_budget(config, temperature_tuning_limit(text_config))
    shape = prepare_model(model, text_config.num_hidden_layers, config.self_check, config.max_model_len)
    fused = fused_projections.fuse_for_engine(model, fusion_off(config))
    draft = None
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        # Under tensor parallelism the draft is whole (not sharded) on rank 0, which alone proposes: its
        # forwards have no collectives, and the other ranks see its proposals in the step inputs.
        draft = load_draft(spec.model, model, tokenizer, config.self_check)
    return model, shape, fused, draft


def allocate_pages(shape: KVShape, plan: StartupPlan, config: EngineConfig, draft: DraftProposer | None
                   ) -> PagedCache:
    """The paged K/V pool the plan sized, and as many pages for the draft model: it reads and writes through the
    target's block tables."""
    cache = PagedCache(shape, plan.cache_pages, config.block_size, plan.kv_dtype, plan.device, plan.groups,
                       null_block=plan.null_block)
    if draft is not None:
        draft.allocate(plan.cache_pages, config.block_size, plan.kv_dtype, plan.device, config.max_num_batched_tokens)
    return cache


def enable_lora(model: PreTrainedModel, config: EngineConfig) -> tuple[LoRARegistry | None, LoRASlots | None]:
    """The adapter registry and the device slots adapters run from, when the config enables LoRA."""
    if not config.enable_lora:
        return None, None
    registry = LoRARegistry(model, config.max_lora_rank)
    return registry, LoRASlots(model, config.max_loras, config.max_lora_rank)
