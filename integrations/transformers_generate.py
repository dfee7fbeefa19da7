"""`model.generate(..., cache_implementation="paged")` on the paged engine, with ordinary `generate` outputs.

`enable()` wraps `GenerationMixin.generate`: a call that asks for the paged cache (as a keyword, in the
`generation_config` it passes, or in `model.generation_config`) runs on one `Engine` per model object;
every other call goes to transformers unchanged. `disable()` restores the original method.

The call is prepared with transformers' own helpers, reached through `hf_generation_prep` (generation config merge, special tokens, attention
mask, `num_return_sequences` expansion, lengths, logits processors, stopping criteria), so options mean
exactly what they mean in `generate`. Each row becomes one engine request (padding stripped). Rows whose
call has logits processors (or asks for scores/logits) get them applied to their logits row inside the
engine step, on a `[1, L]` view of the row as `generate` would see it (padding first); eos and length stop
natively in the engine, any other stopping criterion is checked after each new token and aborts the row.
The engine then only takes the argmax or samples from the processed scores. `prompt_lookup_num_tokens=k`
runs on an engine with n-gram speculation (k tokens, transformers' lookup sizes) and `assistant_model=draft`
on one with the draft model's speculation, batched rows included; greedy output is the one without it, and
scores/logits are those of the kept tokens, one per emitted token (`Row.process`). When sampling, each row gets
its own seed drawn from torch's global generator, so `torch.manual_seed(s)` before the call makes it
reproducible whatever else shares the engine's batch.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from paged_backend.integrations import hf_generation_prep as prep
from paged_backend.integrations import peft_generate
from paged_backend.integrations.beam_generate import generate_beams, wants_beams
from paged_backend.integrations.options.vocabularies import GENERATION_CONFIG
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    PrefixConstrainedLogitsProcessor,
    StoppingCriteriaList,
)
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from paged_backend.config import EngineConfig
from paged_backend.core.outputs import RequestOutput
from paged_backend.engine import Engine
from paged_backend.image_prompts import ProcessedPrompt
from paged_backend.model.adapters import adapter_for
from paged_backend.model.loading.model_check import give_attention_back, switch_to_paged_attention
from paged_backend.model.paged.attention import ATTENTION_NAME
from paged_backend.model.vision.families import family_of
from paged_backend.sampling.sampling_params import SamplingParams
from paged_backend.sampling.structured_outputs import StructuredOutputsParams
from paged_backend.speculative.speculative_config import SpeculativeConfig

PAGED = "paged"
ORIGINAL_GENERATE = GenerationMixin.generate
ENGINE_SLOT = "_paged_backend_engine"
# Models generator_for built an engine for, whose own attention disable() gives back.
_models_run: weakref.WeakSet = weakref.WeakSet()
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# Rows kept in the engine at once when jobs arrive lazily (the pipeline); the engine's own
# max_num_seqs still bounds how many run in one step.
DEFAULT_MAX_ROWS = 1024
# Proposals per step for assistant_model= when num_assistant_tokens is not set (transformers starts at 20 and
# adapts; the engine proposes fewer and leaves adapting to its per-step policy).
DEFAULT_ASSISTANT_TOKENS = 4
# generate()'s own arguments, as opposed to generation options that go into the GenerationConfig.
GENERATE_ARGUMENTS = ("inputs", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                      "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                      "custom_generate", "tokenizer", "cache_implementation", "attention_mask", "input_ids")


# ---------------------------------------------------------------- the hook


def enable() -> None:
    """Route `generate(cache_implementation="paged")` to the paged engine (idempotent)."""
    GenerationMixin.generate = generate


def disable() -> None:
    """Give `generate(cache_implementation="paged")` back to transformers' built-in route, and every model it ran
    its own attention implementation back (transformers' continuous batching refuses the engine's). A model keeps
    its engine: enabled again, `generate` switches it back to the paged attention and runs on that engine."""
    GenerationMixin.generate = ORIGINAL_GENERATE
    for model in list(_models_run):
        give_attention_back(model)


def is_enabled() -> bool:
    return GenerationMixin.generate is generate


@functools.wraps(ORIGINAL_GENERATE)
def generate(self, *args: Any, **kwargs: Any):
    if not wants_paged(self, args, kwargs):
        return ORIGINAL_GENERATE(self, *args, **kwargs)
    return generate_paged(self, *args, **kwargs)


def wants_paged(model: PreTrainedModel, args: tuple, kwargs: dict) -> bool:
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"] == PAGED
    config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    if config is not None and config.cache_implementation is not None:
        return config.cache_implementation == PAGED
    return getattr(model.generation_config, "cache_implementation", None) == PAGED


@torch.no_grad()
def generate_paged(model: PreTrainedModel, *args: Any, **kwargs: Any) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """`generate` with the same arguments, run on the model's engine."""
    generation_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    if wants_beams(model, generation_config, {k: v for k, v in kwargs.items() if k != "generation_config"
                                              and k not in GENERATE_ARGUMENTS}):
        generator = generator_for(model)
        with generator.lock:
            return generate_beams(model, generator.engine, *args, **kwargs)
    job = prepare_job(model, *args, **kwargs)
    adapter_names = peft_generate.row_adapter_names(model)
    if adapter_names is not None:
        return generate_with_adapters(model, job, adapter_names)
    return next(generator_for(model, config_for_speculation(model, job.speculative_config)).run([job]))


def generate_with_adapters(model: PreTrainedModel, job: GenerateJob, adapter_names: list[str]):
    """A PEFT model's mixed-batch call (`adapter_names`): every row runs with its adapter (peft_generate.py)."""
    with peft_generate.engine_runs_the_adapters(model):
        slot = model.__dict__.get(ENGINE_SLOT)
        current = slot.generator.engine.config if slot is not None and slot.generator is not None else None
        generator = generator_for(model, peft_generate.lora_config(model, adapter_names, current))
        job.loras = peft_generate.row_loras(generator.engine, model, adapter_names, len(job.prompts))
        return next(generator.run([job]))


def config_for_speculation(model: PreTrainedModel, spec: dict | None) -> EngineConfig | None:
    """The engine config a call needs: None (any engine will do) unless the model's engine speculates
    differently from what this call asks (prompt lookup or not); then its config with that changed."""
    slot = model.__dict__.get(ENGINE_SLOT)
    current = slot.generator.engine.config if slot is not None and slot.generator is not None else None
    if current is None:
        return EngineConfig(speculative_config=spec) if spec else None
    if current.speculative_config == SpeculativeConfig.from_value(spec):
        return None
    return dataclasses.replace(current, speculative_config=spec)


# ---------------------------------------------------------------- preparing a call


@dataclass(eq=False)
class GenerateJob:
    """One `generate` call, prepared: its rows (expanded for num_return_sequences) and options."""

    input_ids: torch.LongTensor  # [N, W] as given (padding included)
    prompts: list[list[int]]  # per row, the real tokens only
    views: torch.LongTensor  # [N, W + max_new]: padding first, then prompt, then new tokens (what processors see)
    params: list[SamplingParams]
    max_new_tokens: int
    pad_token_id: int | None
    processors: list[LogitsProcessorList]  # per row
    criteria: StoppingCriteriaList  # those the engine does not check itself (not eos, not max length)
    streamer: Any
    return_dict: bool
    output_scores: bool
    output_logits: bool
    speculative_config: dict | None = None  # prompt_lookup_num_tokens / assistant_model: the engine's speculation
    vocabulary: Any = None  # the tokenizer structured outputs are constrained over, when asked for
    loras: list[str | None] | None = None  # per row, the LoRA adapter of a PEFT mixed-batch call
    # A call with images: the processor's image outputs (pixel_values and what goes with them), dealt out to the
    # rows in order (ImagePrompts.rows_with_images); each distinct row repeated `repeats` times.
    image_inputs: dict[str, torch.Tensor] | None = None
    repeats: int = 1

    @property
    def needs_hook(self) -> bool:
        return any(self.processors) or self.output_scores or self.output_logits


def prepare_job(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn: Callable | None = None,
    synced_gpus: bool | None = None,
    assistant_model: PreTrainedModel | None = None,
    streamer: Any = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    custom_generate: Any = None,
    **kwargs: Any,
) -> GenerateJob:
    """Prepare a `generate` call (same arguments) with transformers' helpers, as `generate` itself does."""
    refuse_arguments(prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, synced_gpus=synced_gpus,
                     negative_prompt_ids=negative_prompt_ids,
                     negative_prompt_attention_mask=negative_prompt_attention_mask, custom_generate=custom_generate)
    tokenizer = kwargs.pop("tokenizer", None)
    kwargs.pop("cache_implementation", None)
    structured = structured_outputs_of(kwargs.pop("structured_outputs", None), tokenizer)
    has_default_max_length, has_default_min_length = default_lengths(model, generation_config, kwargs)
    config, model_kwargs = prep.merged_config(model, generation_config, kwargs)
    speculative_config = take_prompt_lookup(config)
    if assistant_model is not None:
        if speculative_config is not None:
            raise ValueError("pass either assistant_model or prompt_lookup_num_tokens, not both")
        speculative_config = take_assistant(config, assistant_model)
    refuse_config(config)
    input_ids, input_name, attention_mask, model_kwargs = prep.prompt_inputs(model, inputs, config, model_kwargs)
    if input_name != "input_ids":
        raise NotImplementedError(f"{input_name} is not supported with cache_implementation='paged'; pass input_ids")
    image_inputs = take_image_inputs(model, model_kwargs)
    refuse_model_kwargs(model_kwargs)
    input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
    attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # transformers' own batch-size rule lives in the streamer
    width = input_ids.shape[1]
    config = prep.generated_length(model, config, has_default_max_length, has_default_min_length, input_ids)
    prep.validate_generated_length(model, config, width, has_default_max_length)
    criteria = prep.stopping_criteria(model, config, stopping_criteria, tokenizer)
    job = build_job(config, input_ids, attention_mask, criteria, streamer, structured)
    job.vocabulary = tokenizer if structured is not None else None
    job.processors = [row_processors(model, config, job, i, logits_processor) for i in range(len(job.prompts))]
    job.speculative_config = speculative_config
    job.image_inputs, job.repeats = image_inputs, config.num_return_sequences
    return job


def take_image_inputs(model: PreTrainedModel, model_kwargs: dict) -> dict[str, torch.Tensor] | None:
    """A vision-language call's image inputs, taken out of the model's keyword arguments (the engine gives each
    row its images); None without pixel_values or for a model whose images the engine does not run (its
    pixel_values are then refused with the other arguments)."""
    family = family_of(model.config)
    if family is None or model_kwargs.get("pixel_values") is None:
        return None
    for key in family.derived_keys:  # what the engine reads from the rows' token ids itself
        model_kwargs.pop(key, None)
    return {key: model_kwargs.pop(key) for key in family.image_keys if model_kwargs.get(key) is not None}


def take_prompt_lookup(config: GenerationConfig) -> dict | None:
    """transformers' prompt lookup options as the engine's n-gram speculation (taken out of the config, which
    then describes plain greedy search or sampling). Its lookup tries n-grams of max_matching_ngram_size
    (default 2) down to 1 tokens."""
    k = config.prompt_lookup_num_tokens
    if not k:
        return None
    config.prompt_lookup_num_tokens = None
    return {"method": "ngram", "num_speculative_tokens": int(k),
            "prompt_lookup_max": int(config.max_matching_ngram_size or 2), "prompt_lookup_min": 1}


def take_assistant(config: GenerationConfig, assistant_model: PreTrainedModel) -> dict:
    """`assistant_model=` as the engine's draft-model speculation, proposing `num_assistant_tokens` (when the
    call or the model's generation config sets it) or DEFAULT_ASSISTANT_TOKENS tokens per step; the
    engine's per-step policy, not transformers' schedule, decides when fewer are proposed."""
    k = config.num_assistant_tokens or DEFAULT_ASSISTANT_TOKENS
    config.num_assistant_tokens = None
    return {"method": "draft_model", "model": assistant_model, "num_speculative_tokens": int(k)}


def structured_outputs_of(spec: Any, tokenizer: Any) -> StructuredOutputsParams | None:
    """`structured_outputs=` (a StructuredOutputsParams or its fields as a dict): every row's answer is
    held to it. The grammar is over a vocabulary, so, as with `stop_strings`, `tokenizer=` is needed."""
    spec = StructuredOutputsParams.of(spec)
    if spec is not None and tokenizer is None:
        raise ValueError("structured_outputs needs the tokenizer: pass tokenizer= to generate")
    return spec


def default_lengths(model: PreTrainedModel, config: GenerationConfig | None, kwargs: dict) -> tuple[bool, bool]:
    """Whether max/min length come from the global defaults (transformers adds them to the prompt length)."""
    def is_default(name: str) -> bool:
        return (kwargs.get(name) is None and (config is None or getattr(config, name) is None)
                and getattr(model.generation_config, name) is None)
    return is_default("max_length"), is_default("min_length")


def row_processors(model: PreTrainedModel, config: GenerationConfig, job: GenerateJob, index: int,
                   custom: LogitsProcessorList | None) -> LogitsProcessorList:
    """transformers' processors for one row, built from that row alone: some take per-row state from the
    batch they are built for (the padding length of each row for the repetition penalty)."""
    width = job.input_ids.shape[1]
    view = job.views[index : index + 1, :width]
    mask = torch.arange(width, device=view.device)[None] >= width - len(job.prompts[index])
    processors = prep.logits_processors(model, config, view, custom, {"attention_mask": mask.long()})
    refuse_processors(processors)
    return processors


def build_job(config: GenerationConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              criteria: StoppingCriteriaList, streamer: Any,
              structured: StructuredOutputsParams | None = None) -> GenerateJob:
    max_new = config.max_length - input_ids.shape[1]
    eos_ids = prep.eos_token_ids(config) or []
    seeds = torch.randint(0, 2**62, (input_ids.shape[0],)).tolist() if config.do_sample else None
    options = {"do_sample": config.do_sample, "max_new_tokens": max_new, "eos_token_id": eos_ids,
               "structured_outputs": structured}
    # ignore_eos: the call's eos ids are the row's whole stop set (GENERATION_CONFIG), not the engine's own.
    params = [GENERATION_CONFIG.params(options, ignore_eos=True, seed=seeds[i] if seeds else None)
              for i in range(input_ids.shape[0])]
    mask = attention_mask.bool().cpu()
    rows = input_ids.cpu()
    views = torch.empty(rows.shape[0], rows.shape[1] + max_new, dtype=torch.long)
    for i in range(rows.shape[0]):
        views[i, : rows.shape[1]] = torch.cat([rows[i][~mask[i]], rows[i][mask[i]]])
    views = views.to(input_ids.device)  # processors combine it with logits on the model's device
    pad = prep.pad_token_id(config)
    return GenerateJob(
        input_ids=input_ids,
        prompts=[rows[i][mask[i]].tolist() for i in range(rows.shape[0])],
        views=views,
        params=params,
        max_new_tokens=max_new,
        pad_token_id=pad,
        processors=[],
        criteria=StoppingCriteriaList(c for c in criteria if not is_native_criterion(c, config)),
        streamer=streamer,
        return_dict=bool(config.return_dict_in_generate),
        output_scores=bool(config.return_dict_in_generate and config.output_scores),
        output_logits=bool(config.return_dict_in_generate and config.output_logits),
    )


def is_native_criterion(criterion: Any, config: GenerationConfig) -> bool:
    """Eos and the call's max length are checked by the engine itself (stop_token_ids, max_tokens)."""
    if type(criterion) is MaxLengthCriteria:
        return criterion.max_length == config.max_length
    if type(criterion) is EosTokenCriteria:
        eos = prep.eos_token_tensor(config)
        return eos is not None and torch.equal(criterion.eos_token_id.cpu(), eos.cpu())
    return False


def refuse_arguments(**arguments: Any) -> None:
    for name, value in arguments.items():
        if value not in (None, False):
            raise NotImplementedError(f"{name} is not supported with cache_implementation='paged'")


def refuse_config(config: GenerationConfig) -> None:
    if config.num_beams is not None and config.num_beams > 1:
        raise NotImplementedError("num_beams > 1 (beam search) runs through model.generate only, not here")
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(f"generation mode {mode.value!r} is not supported with cache_implementation="
                                  "'paged'; only greedy search and sampling are")
    for name in ("output_attentions", "output_hidden_states", "token_healing", "watermarking_config"):
        if getattr(config, name, None):
            raise NotImplementedError(f"{name} is not supported with cache_implementation='paged'")
    if config.guidance_scale not in (None, 1, 1.0):
        raise NotImplementedError("guidance_scale is not supported with cache_implementation='paged'")


def refuse_model_kwargs(model_kwargs: dict) -> None:
    extra = sorted(k for k, v in model_kwargs.items() if v is not None)
    if extra:
        raise NotImplementedError(f"{', '.join(extra)}: not supported with cache_implementation='paged' "
                                  "(only input_ids and attention_mask reach the model)")


def refuse_processors(processors: LogitsProcessorList) -> None:
    for processor in processors:
        if isinstance(processor, PrefixConstrainedLogitsProcessor):
            # It identifies rows by their batch index, which a per-request processor call cannot give it.
            raise NotImplementedError("prefix_allowed_tokens_fn is not supported with cache_implementation='paged'")


# ---------------------------------------------------------------- one engine per model


class EngineSlot:
    """Holds a model's generator in the model's `__dict__`; a copy of the model starts empty, so copies
    never share (or deep-copy) a KV cache."""

    __slots__ = ("generator",)

    def __init__(self) -> None:
        self.generator: PagedGenerator | None = None

    def __deepcopy__(self, memo: dict) -> EngineSlot:
        return EngineSlot()

    def __reduce__(self) -> tuple:
        return (EngineSlot, ())


def generator_for(model: PreTrainedModel, config: EngineConfig | None = None) -> PagedGenerator:
    """The model's engine driver, built on first use and rebuilt only when `config` differs from the one it
    was built with or the model changed under it (another device or dtype, weights replaced). A rebuild keeps the
    config the engine had when no `config` is given (a trainer's `model.to(torch.bfloat16)` between rollouts)."""
    slot = model.__dict__.setdefault(ENGINE_SLOT, EngineSlot())
    current = slot.generator
    if current is None or not current.fits(model, config):
        if config is None and current is not None:
            config = current.engine.config
        slot.generator = None  # free the old cache before allocating the new one
        slot.generator = PagedGenerator(Engine(model, None, config))
        _models_run.add(model)
    elif adapter_for(model.config) is None and model.config._attn_implementation != ATTENTION_NAME:
        switch_to_paged_attention(model)  # switched away since the engine was built (by the user, or generate_batch)
    return slot.generator


def engine_for(model: PreTrainedModel, config: EngineConfig | None = None) -> Engine:
    """The engine `generate(cache_implementation="paged")` uses for `model` (see `generator_for`)."""
    return generator_for(model, config).engine


# ---------------------------------------------------------------- running jobs on the engine


@dataclass(eq=False)
class JobState:
    job: GenerateJob
    rows: list[Row] = field(default_factory=list)
    streamed: int = 0  # columns already put to the streamer

    @property
    def finished(self) -> bool:
        return all(row.done for row in self.rows)


@dataclass(eq=False)
class Row:
    state: JobState
    index: int
    request_id: str
    num_new: int = 0
    done: bool = False
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def job(self) -> GenerateJob:
        return self.state.job

    @property
    def length(self) -> int:
        return self.job.input_ids.shape[1] + self.num_new

    def view(self) -> torch.LongTensor:
        return self.job.views[self.index : self.index + 1, : self.length]

    def process(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """HF's processors on this row's logits `[V]`, as `generate` applies them to its batch row. The row
        has received `num_new` of `output_ids`; a longer list holds tokens speculation is verifying.

        Scores and logits are kept per position (the new token's index, `len(output_ids)`): speculation
        verifies several positions in one step and may reject some, whose entries the next step
        overwrites; only the first `num_new` ever reach the caller (`kept`)."""
        raw = logits.float()[None]
        position = len(output_ids)
        del self.scores[position:], self.logits[position:]
        if self.job.output_logits:
            self.logits.append(raw.clone())
        view = self.view()
        if len(output_ids) > self.num_new:
            extra = torch.tensor(output_ids[self.num_new:], dtype=view.dtype, device=view.device)
            view = torch.cat([view, extra[None]], dim=1)
        scores = self.job.processors[self.index](view, raw.clone() if self.job.output_logits else raw)
        if self.job.output_scores:
            self.scores.append(scores.clone())
        return scores[0]

    def append(self, token: int) -> bool:
        """Record a new token; return whether a stopping criterion the engine does not check ends the row."""
        self.job.views[self.index, self.length] = token
        self.num_new += 1
        if not self.job.criteria:
            return False
        scores = tuple(self.kept(self.scores)) if self.job.output_scores else None
        return bool(self.job.criteria(self.view(), scores).any())

    def kept(self, steps: list[torch.Tensor]) -> list[torch.Tensor]:
        """The entries of the tokens the row received (not those of proposals still being verified)."""
        return steps[: self.num_new]


class PagedGenerator:
    """Drives one engine for `generate` calls and pipelines: submits jobs, steps, routes outputs to rows.

    One run at a time per engine (a lock), since the engine is not thread-safe."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.error: BaseException | None = None  # a processor's own exception, re-raised from step()
        self.rows: dict[str, Row] = {}
        self.lock = threading.RLock()  # a nested run on the same thread shares the engine
        self.next_id = 0
        param = next(engine.model.parameters())
        self.placement = (param.device, param.dtype)

    def fits(self, model: PreTrainedModel, config: EngineConfig | None) -> bool:
        param = next(model.parameters())
        same_config = config is None or config == self.engine.config
        # A compiled forward does not see modules changed since it was compiled (an adapter loaded into the
        # model between calls): such a model gets a new engine.
        return (self.engine.model is model and same_config and (param.device, param.dtype) == self.placement
                and self.engine.runner.model_unchanged())

    def run(self, jobs: Iterable[GenerateJob], max_rows: int = DEFAULT_MAX_ROWS) -> Iterator[Any]:
        """Run every job, pulling jobs lazily (up to `max_rows` rows in the engine at once); yield each
        job's `generate` output, in job order."""
        for state in self.run_states(jobs, max_rows):
            yield build_output(state)

    def run_states(self, jobs: Iterable[GenerateJob], max_rows: int = DEFAULT_MAX_ROWS) -> Iterator[JobState]:
        """`run`, yielding each finished job's state (its rows and their tokens) instead of its output."""
        with self.lock:
            active: deque[JobState] = deque()
            pending = iter(jobs)
            try:
                while True:
                    self.admit(pending, active, max_rows)
                    if not active:
                        return
                    self.step()
                    while active and active[0].finished:
                        yield active.popleft()
            finally:
                self.abandon(active)

    def admit(self, pending: Iterator[GenerateJob], active: deque[JobState], max_rows: int) -> None:
        in_flight = sum(len(state.rows) for state in active)
        while in_flight < max_rows:
            job = next(pending, None)
            if job is None:
                return
            active.append(self.submit(job))
            in_flight += len(job.prompts)

    def submit(self, job: GenerateJob) -> JobState:
        if job.vocabulary is not None:
            self.engine.enable_structured_outputs(job.vocabulary)
        prompts = self.with_images(job)
        for prompt, params in zip(job.prompts, job.params):
            self.engine.inputs.validate(prompt, params)  # every row is checked before any is queued
        state = JobState(job)
        # Rows whose processors, criteria or streamer read the tokens so far need every token as it comes.
        stream = job.needs_hook or bool(job.criteria) or job.streamer is not None
        for i, (prompt, params) in enumerate(zip(prompts, job.params)):
            row = Row(state, i, self.new_request_id())
            self.engine.add_request(prompt, params, request_id=row.request_id, stream=stream,
                                    logits_processor=self.hook(row) if job.needs_hook else None,
                                    lora=job.loras[i] if job.loras else None)
            state.rows.append(row)
            self.rows[row.request_id] = row
        return state

    def with_images(self, job: GenerateJob) -> list[list[int]] | list[ProcessedPrompt]:
        """The rows as the engine takes them: token ids, or with their images (a call with pixel_values)."""
        if job.image_inputs is None:
            return job.prompts
        distinct = self.engine.inputs.images.rows_with_images(job.prompts[::job.repeats], job.image_inputs)
        return [prompt for prompt in distinct for _ in range(job.repeats)]

    def hook(self, row: Row) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
        """HF processors shape the row's distribution before the engine samples from it; the engine turns
        a processor's failure into a request error, so the original exception is kept here too."""

        def process(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            try:
                return row.process(output_ids, logits)
            except BaseException as exc:
                self.error = exc
                raise

        return process

    def new_request_id(self) -> str:
        self.next_id += 1
        return f"generate-{self.next_id}"

    def step(self) -> None:
        outputs = self.engine.step()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        touched: dict[int, JobState] = {}
        for output in outputs:
            row = self.rows.get(output.request_id)
            if row is not None:
                self.receive(row, output)
                touched[id(row.state)] = row.state
        for state in touched.values():
            stream_columns(state)

    def receive(self, row: Row, output: RequestOutput) -> None:
        if output.error is not None:
            raise RuntimeError(f"the engine failed request {row.request_id}: {output.error}")
        for token in output.outputs[0].token_ids[row.num_new :]:
            if row.append(token):
                self.release(row)
                self.engine.abort_request(row.request_id)
                return
        if output.finished:
            self.release(row)

    def release(self, row: Row) -> None:
        row.done = True
        self.rows.pop(row.request_id, None)

    def abandon(self, active: deque[JobState]) -> None:
        """After an exception or an abandoned iterator: free every row of this run still in the engine."""
        for state in active:
            for row in state.rows:
                if not row.done:
                    self.release(row)
                    self.engine.abort_request(row.request_id)
        while self.engine.has_unfinished_requests() and not self.rows:
            self.engine.step()  # deliver the aborts' final outputs now, so the next run starts clean


# ---------------------------------------------------------------- outputs


def stream_columns(state: JobState) -> None:
    """Put token columns to the job's streamer as `generate` does: one `[N]` tensor per step, once every
    row has its token for that step (pad for rows already finished)."""
    job, rows = state.job, state.rows
    if job.streamer is None:
        return
    while all(row.done or row.num_new > state.streamed for row in rows) and \
            any(row.num_new > state.streamed for row in rows):
        column = [row.job.views[row.index, row.job.input_ids.shape[1] + state.streamed].item()
                  if row.num_new > state.streamed else pad_id(job) for row in rows]
        job.streamer.put(torch.tensor(column, dtype=torch.long))
        state.streamed += 1
    if state.finished:
        job.streamer.end()


def pad_id(job: GenerateJob) -> int:
    if job.pad_token_id is None:
        raise ValueError("rows of this generate call stopped at different lengths and there is no pad_token_id "
                         "to fill the shorter ones; pass pad_token_id=...")
    return job.pad_token_id


def build_output(state: JobState) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """What `generate` returns: prompt rows as given, then new tokens, pad after each finished row."""
    job, rows = state.job, state.rows
    length = max(row.num_new for row in rows)
    new = job.views[:, job.input_ids.shape[1] : job.input_ids.shape[1] + length].clone()
    for row in rows:
        if row.num_new < length:
            new[row.index, row.num_new :] = pad_id(job)
    sequences = torch.cat([job.input_ids, new], dim=1)
    if not job.return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=stack_steps([row.kept(row.scores) for row in rows], length) if job.output_scores else None,
        logits=stack_steps([row.kept(row.logits) for row in rows], length) if job.output_logits else None,
    )


def stack_steps(per_row: list[list[torch.Tensor]], length: int) -> tuple[torch.Tensor, ...]:
    """Per-row `[1, V]` tensors to `generate`'s tuple of `[N, V]` per step. A row that finished early has
    -inf there (`generate` computes throwaway values for its padding)."""
    template = next(t for steps in per_row for t in steps)
    filler = torch.full_like(template, float("-inf"))
    return tuple(torch.cat([steps[t] if t < len(steps) else filler for steps in per_row]) for t in range(length))
