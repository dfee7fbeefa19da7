"""transformers' private `generate` preparation, in one place.

`generate(cache_implementation="paged")` prepares a call with the same helpers `generate` uses
(generation config merge, model inputs, special tokens, attention mask, lengths, stopping criteria,
logits processors), so options mean exactly what they mean there. Those helpers and the token
tensors they leave on the config are private to transformers and change between its releases; the
greedy/sampling path (`transformers_generate`) and the beam path (`beam_generate`) reach them only
through this module, so a transformers upgrade is a change here alone
(tests/integrations/test_hf_generation_prep.py checks that no other module names them).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import LogitsProcessorList, StoppingCriteriaList


def merged_config(model: PreTrainedModel, generation_config: GenerationConfig | None,
                  kwargs: dict[str, Any]) -> tuple[GenerationConfig, dict[str, Any]]:
    """(the call's generation config: the model's, the one passed and the keyword options merged;
    the keywords that are model inputs rather than options)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def model_inputs(model: PreTrainedModel, inputs: torch.Tensor | None, config: GenerationConfig,
                 model_kwargs: dict[str, Any]) -> tuple[torch.Tensor, str, dict[str, Any]]:
    """(the input ids, the name of the input they came from, the other model inputs)."""
    return model._prepare_model_inputs(inputs, config.bos_token_id, model_kwargs)


def prepare_special_tokens(model: PreTrainedModel, config: GenerationConfig, has_attention_mask: bool,
                           input_ids: torch.Tensor, per_row: bool = True) -> None:
    """Resolve bos/eos/pad on the config as `generate` does (pad falls back to eos). `per_row`: pass the
    batch size, which transformers uses to check per-row token settings."""
    extra = {"batch_size": input_ids.shape[0]} if per_row else {}
    model._prepare_special_tokens(config, has_attention_mask, device=input_ids.device, **extra)


def prompt_inputs(model: PreTrainedModel, inputs: torch.Tensor | None, config: GenerationConfig,
                  model_kwargs: dict[str, Any], per_row: bool = True
                  ) -> tuple[torch.Tensor, str, torch.Tensor, dict[str, Any]]:
    """(the input ids, the name of the input they came from, their attention mask, the other model inputs),
    with bos/eos/pad resolved on the config: the preparation every `generate` path starts with. The mask is
    the caller's, else the one `generate` infers (see `prepare_special_tokens` for `per_row`)."""
    input_ids, input_name, model_kwargs = model_inputs(model, inputs, config, model_kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    prepare_special_tokens(model, config, attention_mask is not None, input_ids, per_row)
    if attention_mask is None:
        attention_mask = default_attention_mask(model, input_ids, config)
    return input_ids, input_name, attention_mask, model_kwargs


def default_attention_mask(model: PreTrainedModel, input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """The mask `generate` infers when none is given (padding tokens masked out)."""
    return model._prepare_attention_mask_for_generation(input_ids, config, {})


def generated_length(model: PreTrainedModel, config: GenerationConfig, has_default_max_length: bool,
                     has_default_min_length: bool, input_ids: torch.Tensor) -> GenerationConfig:
    """The config with max/min length resolved against the prompt width (max_new_tokens and friends)."""
    return model._prepare_generated_length(config, has_default_max_length, has_default_min_length,
                                           "input_ids", input_ids.shape[1], input_ids)


def validate_generated_length(model: PreTrainedModel, config: GenerationConfig, width: int,
                              has_default_max_length: bool) -> None:
    model._validate_generated_length(config, width, has_default_max_length)


def stopping_criteria(model: PreTrainedModel, config: GenerationConfig, custom: StoppingCriteriaList | None,
                      tokenizer: Any) -> StoppingCriteriaList:
    """transformers' criteria for the config (max length, eos, stop strings, max time) plus `custom`."""
    return model._get_stopping_criteria(config, custom or StoppingCriteriaList(), tokenizer)


def logits_processors(model: PreTrainedModel, config: GenerationConfig, input_ids: torch.Tensor,
                      custom: LogitsProcessorList | None, model_kwargs: dict[str, Any]) -> LogitsProcessorList:
    """transformers' processors for the config, built for `input_ids` (a `[rows, width]` batch), plus `custom`."""
    return model._get_logits_processor(config, input_ids.shape[1], input_ids, None, custom or LogitsProcessorList(),
                                       input_ids.device, model_kwargs)


def eos_token_tensor(config: GenerationConfig) -> torch.Tensor | None:
    """The call's eos ids as `generate` resolved them (after `prepare_special_tokens`)."""
    return config._eos_token_tensor


def eos_token_ids(config: GenerationConfig) -> list[int] | None:
    eos = eos_token_tensor(config)
    return None if eos is None else eos.flatten().tolist()


def pad_token_id(config: GenerationConfig) -> int | None:
    """The call's pad id as `generate` resolved it (eos when the model has no pad token)."""
    pad = config._pad_token_tensor
    return None if pad is None else int(pad)
