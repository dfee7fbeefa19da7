"""PagedTextGenerationPipeline and PagedImageTextToTextPipeline: transformers' text-generation and
image-text-to-text pipelines, with every input of a call in one continuous batch on the paged engine.

The stock pipelines call `generate` once per batch of `batch_size` inputs. These subclasses keep the stock
`preprocess`, `postprocess` and generation-kwargs handling, but turn each preprocessed input into an
engine job and submit them together (pulled lazily from lists, datasets and generators), returning the
outputs in input order (`ContinuousBatching`). `batch_size` and `num_workers` have no effect here: the engine
schedules the batch. An image input's pixels reach the engine with its job (transformers_generate.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import transformers
from transformers import ImageTextToTextPipeline, TextGenerationPipeline
from transformers.utils import ModelOutput

from paged_backend.config import EngineConfig

from .transformers_generate import (
    DEFAULT_MAX_ROWS,
    GenerateJob,
    generator_for,
    prepare_job,
)

TASK = "text-generation"
IMAGE_TASK = "image-text-to-text"


class ContinuousBatching:
    """What both pipelines share: every input of a call an engine job, all in flight together. A subclass says how
    a preprocessed input becomes a job (`start_forward`) and its output the stock `_forward`'s (`finish_forward`).

    Extra constructor arguments: `engine_config` (an EngineConfig for the model's engine, built on first
    use and shared with `generate(cache_implementation="paged")`) and `max_rows` (how many generated rows
    may be in the engine at once while inputs are pulled lazily)."""

    def __init__(self, *args: Any, engine_config: EngineConfig | None = None, max_rows: int = DEFAULT_MAX_ROWS,
                 **kwargs: Any) -> None:
        # Popped before the stock constructor, or they would be taken for generate() arguments.
        self.engine_config = engine_config
        self.max_rows = max_rows
        super().__init__(*args, **kwargs)

    def run_single(self, inputs: Any, preprocess_params: dict, forward_params: dict, postprocess_params: dict) -> Any:
        outputs = self.run_all([inputs], preprocess_params, forward_params, postprocess_params, allow_streamer=True)
        return next(outputs)

    def get_iterator(self, inputs: Iterable, num_workers: int, batch_size: int, preprocess_params: dict,
                     forward_params: dict, postprocess_params: dict) -> Iterator[Any]:
        return self.run_all(inputs, preprocess_params, forward_params, postprocess_params, allow_streamer=False)

    def run_all(self, inputs: Iterable, preprocess_params: dict, forward_params: dict, postprocess_params: dict,
                allow_streamer: bool) -> Iterator[Any]:
        """Every input as one engine job, all in flight together; outputs in input order."""
        if forward_params.get("streamer") is not None and not allow_streamer:
            raise NotImplementedError("streamer with several inputs: the inputs run together, so their tokens "
                                      "would interleave in one streamer; call the pipeline once per input")
        contexts: deque[dict] = deque()

        def jobs() -> Iterator[GenerateJob]:
            for item in inputs:
                job, context = self.start_forward(self.preprocess(item, **preprocess_params), dict(forward_params))
                contexts.append(context)
                yield job

        generator = generator_for(self.model, self.engine_config)
        for output in generator.run(jobs(), self.max_rows):
            model_outputs = self.finish_forward(contexts.popleft(), output)
            yield self.postprocess(model_outputs, **postprocess_params)


class PagedTextGenerationPipeline(ContinuousBatching, TextGenerationPipeline):
    """`pipeline("text-generation", model=m, pipeline_class=PagedTextGenerationPipeline)`."""

    def start_forward(self, model_inputs: dict, generate_kwargs: dict) -> tuple[GenerateJob, dict]:
        """The stock `_forward` up to its `generate` call, which becomes an engine job."""
        model_inputs = self._ensure_tensor_on_device(model_inputs, device=self.device)
        input_ids = model_inputs["input_ids"]
        attention_mask = model_inputs.get("attention_mask", None)
        if input_ids.shape[1] == 0:  # an empty prompt: generate starts from bos
            input_ids = attention_mask = None
            in_b = 1
        else:
            in_b = input_ids.shape[0]
        prefix_length = generate_kwargs.pop("prefix_length", 0)
        generate_kwargs = self._prepare_generate_kwargs(generate_kwargs)
        if prefix_length:  # a total length (as opposed to a number of new tokens) has to include the prefix
            generation_params = self._get_set_generation_params(generate_kwargs)
            for length, new_tokens in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
                if length in generation_params and new_tokens not in generation_params:
                    generate_kwargs[length] = generation_params[length] + prefix_length
        if generate_kwargs.get("structured_outputs") is not None:  # the grammar needs the vocabulary
            generate_kwargs.setdefault("tokenizer", self.tokenizer)
        with torch.no_grad():
            job = prepare_job(self.model, input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
        context = {"input_ids": input_ids, "in_b": in_b, "prompt_text": model_inputs["prompt_text"]}
        return job, context

    def finish_forward(self, context: dict, output: Any) -> dict:
        """The stock `_forward` after its `generate` call: reshape to `[in_b, n, L]`, keep extra outputs."""
        in_b = context["in_b"]
        if isinstance(output, ModelOutput):
            generated_sequence = output.sequences
            other_outputs = {k: v for k, v in output.items() if k not in {"sequences", "cache"}}
            out_b = generated_sequence.shape[0]
            for key, value in other_outputs.items():
                if isinstance(value, torch.Tensor) and value.shape[0] == out_b:
                    other_outputs[key] = value.reshape(in_b, out_b // in_b, *value.shape[1:])
                if isinstance(value, tuple) and len(value[0]) == out_b:
                    value = torch.stack(value).swapaxes(0, 1)
                    other_outputs[key] = value.reshape(in_b, out_b // in_b, *value.shape[1:])
        else:
            generated_sequence = output
            other_outputs = {}
        out_b = generated_sequence.shape[0]
        generated_sequence = generated_sequence.reshape(in_b, out_b // in_b, *generated_sequence.shape[1:])
        model_outputs = {
            "generated_sequence": generated_sequence.cpu(),
            "input_ids": context["input_ids"],
            "prompt_text": context["prompt_text"],
        }
        model_outputs.update({k: v.cpu() for k, v in other_outputs.items() if isinstance(v, torch.Tensor)})
        return model_outputs


class PagedImageTextToTextPipeline(ContinuousBatching, ImageTextToTextPipeline):
    """`pipeline("image-text-to-text", model=m, processor=p, pipeline_class=PagedImageTextToTextPipeline)`."""

    def start_forward(self, model_inputs: dict, forward_params: dict) -> tuple[GenerateJob, dict]:
        """The stock `_forward` up to its `generate` call, which becomes an engine job with the input's images."""
        model_inputs = dict(self._ensure_tensor_on_device(model_inputs, device=self.device))
        prompt_text = model_inputs.pop("text")
        generate_kwargs = self._prepare_generate_kwargs(dict(forward_params.get("generate_kwargs") or {}),
                                                        return_dict_in_generate=False)
        with torch.no_grad():
            job = prepare_job(self.model, **model_inputs, **generate_kwargs)
        return job, {"input_ids": model_inputs["input_ids"], "prompt_text": prompt_text}

    def finish_forward(self, context: dict, output: Any) -> dict:
        """The stock `_forward` after its `generate` call: `[in_b, n, L]` when an input has several sequences."""
        input_ids, generated = context["input_ids"], output
        if generated.ndim == 2 and generated.shape[0] > input_ids.shape[0]:
            generated = generated.reshape(input_ids.shape[0], -1, generated.shape[-1])
        return {"generated_sequence": generated, "prompt_text": context["prompt_text"], "input_ids": input_ids}


PIPELINES = {TASK: PagedTextGenerationPipeline, IMAGE_TASK: PagedImageTextToTextPipeline}


def pipeline(task: str = TASK, model: Any = None, tokenizer: Any = None,
             **kwargs: Any) -> PagedTextGenerationPipeline | PagedImageTextToTextPipeline:
    """`transformers.pipeline(task, model, ..., pipeline_class=...)` for the text-generation and
    image-text-to-text tasks; model None loads the default model (paged_backend.DEFAULT_MODEL)."""
    if task not in PIPELINES:
        raise ValueError(f"paged_backend.pipeline supports the {' and '.join(map(repr, PIPELINES))} tasks, "
                         f"got {task!r}")
    if model is None:
        from paged_backend.model.loading.model_loader import load_model

        model, tokenizer = load_model(None, tokenizer)
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, pipeline_class=PIPELINES[task], **kwargs)
