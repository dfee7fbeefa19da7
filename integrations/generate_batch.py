"""`generate_batch` on the paged engine: transformers' continuous-batching entry point (token lists in, a dict of
`GenerationOutput`s out), taken by the engine when the generation config asks for `cache_implementation="paged"`,
as `generate` is. TRL's `use_transformers_continuous_batching=True` calls it with its trainer's generation config,
so `GRPOConfig(use_transformers_continuous_batching=True, cache_implementation="paged")` makes its rollouts here,
from the very weights the optimizer updates (the engine follows in-place changes, model_state.py).

Each prompt is one `generate` call of one row (`prepare_job`: the same options, logits processors and stops as
`generate`), and all run together on the model's engine, shared with `generate`. Of `continuous_batching_config`:
- `return_logprobs` gives each sampled token's log-probability under the distribution it was sampled from (after
  temperature, top-k/p, penalties: transformers' processors as `generate` applies them);
- the fields that size and tune transformers' own engine (pages, memory share, batch limits, CUDA graphs, compile
  levels, queues) do not apply: the model's engine is sized by its `EngineConfig`, and the first use says so once.
`record_timestamps=True` is refused: the engine's outputs carry no per-token times.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from paged_backend.model.loading.model_check import own_attention

from .transformers_generate import PAGED, JobState, generator_for, prepare_job

logger = logging.getLogger(__name__)

ORIGINAL_GENERATE_BATCH = GenerationMixin.generate_batch
_said_ignored = False


def enable() -> None:
    """Route `generate_batch` with a paged generation config to the engine (idempotent)."""
    GenerationMixin.generate_batch = generate_batch


def disable() -> None:
    if GenerationMixin.__dict__.get("generate_batch") is generate_batch:
        del GenerationMixin.generate_batch  # transformers' own (ContinuousMixin's) shows through again


def generate_batch(self: PreTrainedModel, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   continuous_batching_config: Any = None, record_timestamps: bool = False, progress_bar: bool = False,
                   persistent_manager: bool = False, warmup: bool = True, **kwargs: Any) -> dict[str, GenerationOutput]:
    config = generation_config if generation_config is not None else self.generation_config
    if getattr(config, "cache_implementation", None) != PAGED:
        with own_attention(self):  # transformers' continuous batching refuses the engine's attention
            return ORIGINAL_GENERATE_BATCH(self, inputs, generation_config, continuous_batching_config,
                                           record_timestamps, progress_bar, persistent_manager, warmup, **kwargs)
    if record_timestamps:
        raise NotImplementedError("generate_batch(record_timestamps=True) is not supported with "
                                  "cache_implementation='paged': the engine's outputs carry no per-token times")
    return generate_batch_paged(self, inputs, config, continuous_batching_config, kwargs)


@torch.no_grad()
def generate_batch_paged(model: PreTrainedModel, inputs: list[list[int]], config: GenerationConfig,
                         cb_config: Any, kwargs: dict[str, Any]) -> dict[str, GenerationOutput]:
    """Every prompt as a one-row `generate` job on the model's engine; outputs keyed and ordered as transformers'
    (a prompt's extra samples `<id>__child#<k>` first, then `<id>`)."""
    if not inputs:
        return {}
    unknown = sorted(set(kwargs) - {"max_new_tokens"})
    if unknown:
        raise TypeError(f"generate_batch got unexpected arguments: {', '.join(unknown)}")
    logprobs = bool(getattr(cb_config, "return_logprobs", False))
    say_ignored(cb_config)
    device = next(model.parameters()).device
    options = {"max_new_tokens": kwargs["max_new_tokens"]} if kwargs.get("max_new_tokens") is not None else {}
    jobs = []
    for prompt in inputs:
        job = prepare_job(model, torch.tensor([prompt], device=device), generation_config=config, **options)
        job.output_scores = job.output_scores or logprobs  # the processed scores the logprobs are read from
        jobs.append(job)
    generator = generator_for(model)
    results: dict[str, GenerationOutput] = {}
    for i, (prompt, state) in enumerate(zip(inputs, generator.run_states(jobs))):
        outputs = outputs_of(f"req_{i}", prompt, state, logprobs)
        results.update({o.request_id: o for o in outputs[1:]})  # children first, as transformers orders them
        results[outputs[0].request_id] = outputs[0]
    return results


def outputs_of(request_id: str, prompt: list[int], state: JobState, logprobs: bool) -> list[GenerationOutput]:
    """One GenerationOutput per row of a finished job: the parent's first, then its children's."""
    width = state.job.input_ids.shape[1]
    outputs = []
    for k, row in enumerate(state.rows):
        tokens = state.job.views[row.index, width:width + row.num_new].tolist()
        values = []
        if logprobs:
            for scores, token in zip(row.kept(row.scores), tokens):
                values.append(torch.log_softmax(scores[0].float(), dim=-1)[token].item())
        name = request_id if k == 0 else f"{request_id}__child#{k - 1}"
        outputs.append(GenerationOutput(request_id=name, prompt_ids=list(prompt), generated_tokens=tokens,
                                        logprobs=values, status=RequestStatus.FINISHED))
    return outputs


TUNING_FIELDS = ("num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch", "use_cuda_graph",
                 "scheduler_type", "block_size", "page_size")


def say_ignored(cb_config: Any) -> None:
    """Say once that transformers' engine settings do not size this engine (which EngineConfig does)."""
    global _said_ignored
    if cb_config is None or _said_ignored:
        return
    _said_ignored = True
    logger.info("generate_batch with cache_implementation='paged': continuous_batching_config sizes transformers' "
                "own engine (%s) and does not apply; the paged engine is sized by its EngineConfig",
                ", ".join(TUNING_FIELDS))
