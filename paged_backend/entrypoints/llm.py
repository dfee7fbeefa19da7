"""LLM: the offline API. Load a model once, generate for many prompts in one continuous batch."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from paged_backend.config import EngineConfig
from paged_backend.core.outputs import RequestOutput
from paged_backend.core.pooling import PoolingParams
from paged_backend.engine import Engine, Prompt
from paged_backend.image_prompts import ProcessedPrompt, check_images_allowed, is_image_prompt
from paged_backend.entrypoints.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search,
)
from paged_backend.entrypoints.chat import render_chat
from paged_backend.entrypoints.chat_turn import ChatTurn, NeedsReasoningModel, build_chat_turn
from paged_backend.entrypoints.reasoning import resolve_reasoning_parser
from paged_backend.model.paged.attention import ATTENTION_NAME, register
from paged_backend.model.lora import LoRARequest, LoRASpec
from paged_backend.model.loading.model_loader import gguf_file_of, is_default_model, load_model
from paged_backend.model.quantized.half_head import keep_head_in_half
from paged_backend.model.quantized.quantization import (
    AUTO,
    CHECKPOINT_METHODS,
    check_checkpoint_method,
    check_method,
    quantize_weights,
    resolve_method,
)
from paged_backend.parallel.launch import TensorParallelGroup
from paged_backend.parallel.step_protocol import broadcast_step, serve_steps
from paged_backend.sampling.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
LOAD_KEYS = ("dtype", "device", "trust_remote_code")


class LLM:
    """`LLM(model)` where model is a hub id, a folder, a `.gguf` file, None (the default model) or a
    loaded `PreTrainedModel` (used as it is); extra keywords are EngineConfig fields.
    `quantization="int8"` or `"int4"` quantizes the linear layers' weights after loading (a loaded model's in
    place; quantization.py; int4 takes a GGUF source's own Q4_1 tensors, the default model's included); it
    compiles where the engine's `compile` setting says, as without quantization. The default `"auto"` runs
    the default model as int4 on CPU unless `dtype=torch.float32` is named, and quantizes nothing else; None
    never quantizes. A GPTQ, AWQ or compressed-tensors folder loads quantized as it is (checkpoint_quantizer.py);
    `quantization="gptq"` (`"awq"`, `"compressed-tensors"`) refuses a folder in any other format. `reasoning_parser` (a name, "auto" for the chat template's markers, or None) makes
    `chat` split a reasoning model's thinking into each completion's `reasoning` (docs/reasoning.md)."""

    def __init__(self, model: Any = None, tokenizer: Any = None, tensor_parallel_size: int = 1,
                 quantization: str | None = AUTO, reasoning_parser: str | None = None,
                 **engine_config: Any) -> None:
        # Workers run the target's forwards only: proposals (a draft model's too) reach them inside rank 0's
        # step inputs, so they get no speculative_config (nor a loaded draft to unpickle).
        worker_config = {k: v for k, v in engine_config.items() if k != "speculative_config"}
        spawn_args = (model, tokenizer, worker_config, tensor_parallel_size)
        load_kwargs = {k: engine_config.pop(k) for k in LOAD_KEYS if k in engine_config}
        config = EngineConfig(**engine_config)
        check_method(quantization)
        if quantization not in (None, AUTO) and tensor_parallel_size > 1:
            raise ValueError("quantization= with tensor_parallel_size > 1 is not supported")
        register()
        self.tp_group = None
        if tensor_parallel_size > 1:
            self.tp_group = TensorParallelGroup.join(tensor_parallel_size, run_worker, spawn_args)
            load_kwargs["tp_plan"] = "auto"
            if config.num_threads is None and not torch.cuda.is_available():
                config.num_threads = max(1, (os.cpu_count() or 1) // tensor_parallel_size)
        try:
            self.engine = self.build_engine(model, tokenizer, config, quantization, load_kwargs)
        except BaseException:
            # A spawned group left behind would hold this process's place in torch.distributed: the next
            # LLM here would take it for torchrun's, and every later engine for a tensor-parallel one.
            if self.tp_group is not None and not self.tp_group.launched_by_torchrun:
                self.tp_group.abandon()
            raise
        self.reasoning = resolve_reasoning_parser(reasoning_parser, self.engine.tokenizer)
        if not self.is_leader:
            self.serve_as_worker()

    @property
    def is_leader(self) -> bool:
        return self.tp_group is None or self.tp_group.rank == 0

    def build_engine(self, source: Any, tokenizer: Any, config: EngineConfig, quantization: str | None,
                     load_kwargs: dict[str, Any]) -> Engine:
        model, tokenizer = load_model(source, tokenizer, attn_implementation=ATTENTION_NAME, **load_kwargs)
        param = next(model.parameters())
        method = resolve_method(quantization, is_default_model(source), param.device, param.dtype,
                                single_process=self.tp_group is None,
                                dtype_named=load_kwargs.get("dtype") not in (None, "auto"))
        if method in CHECKPOINT_METHODS:
            check_checkpoint_method(model, method)
        elif method is not None:
            quantize_weights(model, method, gguf_file_of(source) if method == "int4" else None)
        # Only a model loaded here (a caller's own model object stays as given). Not with adapters, which may target
        # the head, nor under tensor parallelism, which splits it.
        loaded_here = source is None or isinstance(source, (str, os.PathLike))
        if loaded_here and not config.enable_lora and self.tp_group is None:
            keep_head_in_half(model)
        if not self.is_leader:  # under torchrun every rank gets the caller's arguments: the draft runs on rank 0 only
            config.speculative_config = None
        publish = broadcast_step if self.tp_group is not None and self.is_leader else None
        return Engine(model, tokenizer, config, publish_step=publish)

    def serve_as_worker(self) -> None:
        """A rank other than 0 runs rank 0's steps until it closes; under torchrun the script ends there."""
        serve_steps(self.engine.runner)
        self.tp_group.close()
        if self.tp_group.launched_by_torchrun:
            raise SystemExit(0)

    def close(self) -> None:
        """Write what the second KV tier still has queued, and stop tensor-parallel workers."""
        self.engine.flush_offload()
        if self.tp_group is not None:
            self.tp_group.close()

    def add_lora(self, name: str, source: Any, adapter_name: str | None = None) -> None:
        """Register a LoRA adapter (a PEFT folder or a loaded PeftModel) under `name`; needs enable_lora=True."""
        self.engine.add_lora(name, source, adapter_name)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes, so the next prompts are computed afresh (between a benchmark's rounds);
        False, with nothing changed, while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    @property
    def model(self):
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: LoRASpec | Sequence[LoRASpec | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) at once; outputs come back in input order.
        `lora`: one adapter (name or LoRARequest) for every prompt, or one per prompt (None: the base).

        Every prompt is validated before any is queued, so an invalid one raises ValueError (naming
        its index) without leaving half a batch in the engine."""
        prompts = normalise_prompts(prompts)
        params = normalise_params(sampling_params, len(prompts))
        return self.run(prompts, params, use_tqdm, normalise_loras(lora, len(prompts)))

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """Embed every prompt (text or token ids) at once: its final hidden states pooled (the last token's by
        default, or their mean) and L2-normalised, in `output.embedding` (fp32, CPU); outputs in input order.
        The prompts run through the engine's own steps, batched like prefills, and keep no KV afterwards.
        Every prompt is validated before any is queued (ValueError naming its index)."""
        engine, pooling = self.engine, pooling or PoolingParams()
        prompts = normalise_prompts(prompts)
        token_ids = []
        for i, prompt in enumerate(prompts):
            try:
                token_ids.append(engine.inputs.tokenize(prompt)[1])
                engine.inputs.validate_pooling(token_ids[-1], pooling)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        ids = [engine.add_pooling_request(prompt, pooling, prompt_token_ids=ids) for prompt, ids in zip(prompts, token_ids)]
        return self.collect(ids, use_tqdm, "Embedding")

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora: LoRASpec | None = None) -> list[BeamSearchOutput]:
        """Beam search per prompt, with transformers' scoring and stopping rules; sequences best first.
        With `lora`, every prompt's beams run with that adapter."""
        token_lists = []
        for i, prompt in enumerate(normalise_prompts(prompts)):
            try:
                _, ids = self.engine.inputs.tokenize(prompt)
                self.engine.inputs.validate(ids, SamplingParams(max_tokens=params.max_tokens))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
            token_lists.append(ids)
        outputs = beam_search(self.engine, token_lists, params, lora)
        if self.tokenizer is not None:
            for output in outputs:
                for sequence in output.sequences:
                    sequence.text = self.tokenizer.decode(sequence.token_ids, skip_special_tokens=True)
        return outputs

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        thinking_token_budget: int | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation (OpenAI-shaped messages) through the chat template and generate.
        `tools` (OpenAI function tools) follow the shared tool policy (paged_backend/entrypoints/chat.py): rendered
        by a template that supports tools, else described Hermes style in the system turn; past
        assistant `tool_calls` and `tool` results are rendered the same way. With a reasoning parser,
        each completion's thinking is in `reasoning` and its `text` is the answer alone;
        `thinking_token_budget` closes the thinking past that many tokens."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = normalise_params(sampling_params, len(conversations))
        turns = [self.chat_turn(c, p, add_generation_prompt, tools, chat_template_kwargs or {}, thinking_token_budget)
                 for c, p in zip(conversations, params)]
        processors = [turn.processor for turn in turns] if thinking_token_budget is not None else None
        outputs = self.run([turn.engine_prompt for turn in turns], [turn.params for turn in turns], use_tqdm, None,
                           processors)
        if self.reasoning is not None:
            marked = any(marker in self.tokenizer.all_special_tokens for marker in self.reasoning.markers)
            for output, turn in zip(outputs, turns):
                for completion in output.outputs:
                    text = self.marked_text(completion.token_ids) if marked else completion.text
                    completion.reasoning, completion.text = turn.reader.split_reasoning(text)
        return outputs

    def chat_turn(self, conversation: Conversation, params: SamplingParams, add_generation_prompt: bool,
                  tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any],
                  budget: int | None) -> ChatTurn:
        """One conversation's turn. The caller's sampling parameters keep their decoding (the markers are
        read back from the token ids, `marked_text`); no tool-call format is read, so no call is parsed."""
        try:
            return build_chat_turn(self.tokenizer, conversation, params, tools=tools, reasoning=self.reasoning,
                                   thinking_budget=budget, template_kwargs=template_kwargs,
                                   add_generation_prompt=add_generation_prompt, keep_markers=False,
                                   image_prompts=self.engine.inputs.image_prompts())
        except NeedsReasoningModel:
            raise ValueError("thinking_token_budget needs a reasoning model: pass LLM(..., reasoning_parser=...)") from None

    def marked_text(self, token_ids: Sequence[int]) -> str:
        """A completion's text with its special tokens kept, for a reasoning format whose markers are special
        tokens (gpt-oss's harmony: decoding drops them otherwise), less the EOS that ended it."""
        ids = list(token_ids)
        if ids and ids[-1] in self.engine.eos_token_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_chat(self, conversation: Conversation, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None, extra: dict[str, Any]) -> list[int]:
        return render_chat(self.tokenizer, conversation, tools, add_generation_prompt=add_generation_prompt,
                           template_kwargs=extra)

    def run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
            loras: list[LoRASpec | None] | None = None, processors: list[Any] | None = None) -> list[RequestOutput]:
        engine = self.engine
        loras = loras or [None] * len(prompts)
        processors = processors or [None] * len(prompts)

        prompts = processed_images(engine.inputs.read_images, prompts, params)  # once, before anything is queued

        def check(token_ids: list[int], p: SamplingParams, lora: LoRASpec | None) -> None:
            engine.inputs.validate(token_ids, p)
            engine.resolve_lora(lora)

        token_ids = checked_token_ids(engine.inputs.tokenize, check, prompts, params, loras)
        ids = [engine.add_request(prompt, p, stream=False, prompt_token_ids=ids, lora=lora, logits_processor=proc)
               for prompt, p, ids, lora, proc in zip(prompts, params, token_ids, loras, processors)]
        return self.collect(ids, use_tqdm, "Generating")

    def collect(self, ids: list[str], use_tqdm: bool, label: str) -> list[RequestOutput]:
        """Step the engine until every request in `ids` has finished; their final outputs in that order."""
        engine = self.engine
        index = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), disable=not use_tqdm, desc=label, unit="req") as bar:
            remaining = len(ids)
            while remaining:
                for output in engine.step():
                    if output.finished and output.request_id in index:
                        results[index[output.request_id]] = output
                        remaining -= 1
                        bar.update(1)
        return results


def normalise_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or is_image_prompt(prompts):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def normalise_params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def processed_images(read: Callable[[Prompt], ProcessedPrompt], prompts: list[Prompt],
                     params: list[SamplingParams]) -> list[Prompt]:
    """The prompts, those with images through the processor (`read`) and checked against their params; ValueError
    naming the index of one refused."""
    processed = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        try:
            processed.append(read(prompt) if is_image_prompt(prompt) else prompt)
            check_images_allowed(getattr(processed[-1], "images", ()), p)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    return processed


def checked_token_ids(tokenize: Callable[[Prompt], tuple[str | None, list[int]]],
                      check: Callable[[list[int], SamplingParams, LoRASpec | None], None], prompts: list[Prompt],
                      params: list[SamplingParams], loras: list[LoRASpec | None]) -> list[list[int]]:
    """Every prompt's token ids, each prompt checked before any is queued, so a bad one raises ValueError
    naming its index without leaving half a batch behind."""
    token_ids = []
    for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
        try:
            token_ids.append(tokenize(prompt)[1])
            check(token_ids[-1], p, lora)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    return token_ids


def normalise_loras(lora: LoRASpec | Sequence[LoRASpec | None] | None, n: int) -> list[LoRASpec | None]:
    if lora is None or isinstance(lora, (str, LoRARequest)):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} LoRA choices for {n} prompts")
    return loras


def run_worker(model: Any, tokenizer: Any, kwargs: dict, size: int) -> None:
    """A spawned rank's life: build the same LLM, which serves rank 0's steps until it closes."""
    LLM(model, tokenizer, tensor_parallel_size=size, **kwargs)
