"""`generate(num_beams > 1, cache_implementation="paged")`: transformers' beam search on the engine.

The call is prepared with transformers' helpers (through `hf_generation_prep`) as for greedy and sampling, then each input row runs
through `paged_backend.entrypoints.beam_search`, which follows transformers' ranking, length penalty and
early-stopping rules step for step; beams share their prompt's blocks through the prefix cache. The
result is what `generate` returns: each row's best `num_return_sequences` beams, prompt as given,
padded after shorter beams. Options that change beam search beyond eos, lengths, length penalty and
early stopping (logits processors, extra stopping criteria, streamers, scores) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from paged_backend.integrations import hf_generation_prep as prep
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from paged_backend.engine import Engine
from paged_backend.entrypoints.beam_search import BeamSearchParams, beam_search


def wants_beams(model: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict) -> bool:
    config, _ = prep.merged_config(model, generation_config, dict(kwargs))
    return config.num_beams is not None and config.num_beams > 1


def generate_beams(model: PreTrainedModel, engine: Engine, inputs: torch.Tensor | None = None,
                   generation_config: GenerationConfig | None = None,
                   logits_processor: LogitsProcessorList | None = None,
                   stopping_criteria: StoppingCriteriaList | None = None, streamer: Any = None,
                   **kwargs: Any) -> torch.LongTensor:
    refuse(logits_processor=logits_processor, stopping_criteria=stopping_criteria, streamer=streamer,
           tokenizer=kwargs.pop("tokenizer", None))
    kwargs.pop("cache_implementation", None)
    config, model_kwargs = prep.merged_config(model, generation_config, kwargs)
    if config.get_generation_mode() is not GenerationMode.BEAM_SEARCH:
        raise NotImplementedError(f"generation mode {config.get_generation_mode().value!r} is not supported with "
                                  "cache_implementation='paged'; of the beam modes only plain beam search is")
    refuse(return_dict_in_generate=config.return_dict_in_generate, stop_strings=config.stop_strings,
           max_time=config.max_time)
    input_ids, _, attention_mask, _ = prep.prompt_inputs(model, inputs, config, model_kwargs, per_row=False)
    width = input_ids.shape[1]
    config = prep.generated_length(model, config, kwargs.get("max_length") is None and
                                   model.generation_config.max_length is None, True, input_ids)
    refuse_processors(model, config, input_ids)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    eos = prep.eos_token_ids(config)
    params = BeamSearchParams(
        beam_width=config.num_beams, max_tokens=config.max_length - width,
        length_penalty=config.length_penalty, early_stopping=config.early_stopping,
        ignore_eos=eos is None, eos_token_ids=None if eos is None else tuple(eos),
    )
    outputs = beam_search(engine, prompts, params)
    return assemble(input_ids, [o.sequences[: config.num_return_sequences] for o in outputs], config)


def assemble(input_ids: torch.Tensor, beams: list[list[Any]], config: GenerationConfig) -> torch.LongTensor:
    """Rows as `generate` lays them out: the prompt as given, then the beam, then fill."""
    pad, eos = prep.pad_token_id(config), prep.eos_token_ids(config)
    fill = pad if pad is not None else eos[0] if eos is not None else -1
    length = max(len(b.token_ids) for row in beams for b in row)
    rows = []
    for prompt, row_beams in zip(input_ids.cpu(), beams):
        for beam in row_beams:
            tail = beam.token_ids + [fill] * (length - len(beam.token_ids))
            rows.append(torch.cat([prompt, torch.tensor(tail, dtype=prompt.dtype)]))
    return torch.stack(rows).to(input_ids.device)


def refuse(**options: Any) -> None:
    for name, value in options.items():
        if value not in (None, False) and not (hasattr(value, "__len__") and len(value) == 0):
            raise NotImplementedError(f"{name} is not supported with num_beams > 1 and cache_implementation='paged'")


def refuse_processors(model: PreTrainedModel, config: GenerationConfig, input_ids: torch.Tensor) -> None:
    processors = prep.logits_processors(model, config, input_ids, None, {})
    if processors:
        names = ", ".join(type(p).__name__ for p in processors)
        raise NotImplementedError(f"{names}: logits processors are not supported with num_beams > 1 and "
                                  "cache_implementation='paged'")
