"""One translation table per option vocabulary into SamplingParams (`translation.Translation`).

Adding a sampling option means a field on SamplingParams and a row in each table whose vocabulary has
it. A front end reads its options, refuses those outside its table by name, and builds SamplingParams
through the table; none of them copies options field by field itself. Defaults are in `defaults.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_backend.sampling.sampling_params import SamplingParams

from .translation import Translation, table


def as_list(value: Any) -> list:
    """None -> [], one string or id -> [it], else a list of the items."""
    if value is None:
        return []
    return [value] if isinstance(value, (str, int)) else list(value)


def sample_if(do_sample: bool) -> float:
    """transformers' do_sample as the engine's temperature: 1.0 samples from the scores the row's own
    logits processors produced (temperature, top-k/p, penalties), 0.0 takes their argmax."""
    return 1.0 if do_sample else 0.0


# The OpenAI API's request fields and vLLM's extras on it (server/protocol.py's SamplingFields).
# `n`/`best_of` become the engine request's samples, `max_tokens` comes from max_tokens or
# max_completion_tokens, `logprobs` from logprobs/top_logprobs, `structured_outputs` from
# response_format, tool_choice or the guided_* fields: the routes pass those in SamplingParams' names.
OPENAI: Translation = table("OpenAI request", {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "min_tokens": "min_tokens",
    "stop": ("stop", as_list),
    "stop_token_ids": ("stop_token_ids", as_list),
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
})

# vLLM's older /generate body: SamplingParams' own field names, each unchanged.
SAMPLING_PARAMS: Translation = table("SamplingParams", {f.name: f.name for f in dataclasses.fields(SamplingParams)})

# PagedLLM / ChatPaged constructor fields and per-call options (langchain/options.py). Their stop strings
# are the union of the constructor's and the call's before they are translated.
LANGCHAIN: Translation = table("LangChain", {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "n": "n",
    "best_of": "best_of",
    "structured_outputs": "structured_outputs",
    "stop": ("stop", as_list),
    "truncate_prompt_tokens": "truncate_prompt_tokens",
})

# transformers' GenerationConfig, after transformers prepared it (integrations/transformers_generate.py).
# Temperature, top-k/p, penalties and min lengths are not translated: transformers' own logits processors
# apply them to each row inside the engine step, so `generate` keeps their exact meaning; eos is the
# engine's stop ids (with the engine's own eos set ignored), so a call's eos_token_id is the whole set.
GENERATION_CONFIG: Translation = table("GenerationConfig", {
    "do_sample": ("temperature", sample_if),
    "max_new_tokens": "max_tokens",
    "eos_token_id": ("stop_token_ids", as_list),
    "structured_outputs": "structured_outputs",
})

# The `paged-backend` command's sampling flags (flag --max-tokens is option max_tokens). Their type, help
# and default come from SamplingParams and defaults.CLI (flags.add_sampling_flags).
CLI: Translation = table("command-line", {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
})
