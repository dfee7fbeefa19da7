"""One translation table per option vocabulary into SamplingParams (`translation.Translation`).

Adding a sampling option means a field on SamplingParams, a row in each table whose vocabulary has it,
and their tests; nothing else. A row of a table whose front end is a schema (OPENAI: the server's
request models; LANGCHAIN: PagedLLM/ChatPaged's fields) also says how that schema declares the option
(`translation.Wire`: type, default, constraints, description), and the schema's fields are generated
from it (`schema.options_model`). The command line's flags are generated from SamplingParams
(`flags.py`). A front end reads its options, refuses those outside its table by name, and builds
SamplingParams through the table; none of them declares or copies options field by field itself.
Defaults are in `defaults.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_backend.sampling.sampling_params import SamplingParams

from . import defaults
from .translation import Translation, table, wire

# The seeds the engine's generator accepts, with room for each sample's seed + i (torch takes
# [-2**63, 2**64 - 1]); OpenAI documents seed as a 64-bit signed integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def as_list(value: Any) -> list:
    """None -> [], one string or id -> [it], else a list of the items."""
    if value is None:
        return []
    return [value] if isinstance(value, (str, int)) else list(value)


def sample_if(do_sample: bool) -> float:
    """transformers' do_sample as the engine's temperature: 1.0 samples from the scores the row's own
    logits processors produced (temperature, top-k/p, penalties), 0.0 takes their argmax."""
    return 1.0 if do_sample else 0.0


# The OpenAI API's request fields and vLLM's extras on it (server/protocol.py's SamplingFields, whose fields
# for these options are generated from the rows: OpenAI's wire type, default and range).
# `n`/`best_of` become the engine request's samples, `max_tokens` comes from max_tokens or
# max_completion_tokens, `logprobs` from logprobs/top_logprobs, `structured_outputs` from
# response_format, tool_choice or the guided_* fields: the routes pass those in SamplingParams' names.
OPENAI: Translation = table("OpenAI request", {
    "temperature": ("temperature", wire(float, defaults.OPENAI["temperature"], ge=0.0, le=2.0)),
    "top_p": ("top_p", wire(float, 1.0, gt=0.0, le=1.0)),
    "top_k": ("top_k", wire(int, defaults.OPENAI["top_k"], ge=-1)),
    "min_p": ("min_p", wire(float, 0.0, ge=0.0, le=1.0)),
    "repetition_penalty": ("repetition_penalty", wire(float, 1.0, gt=0.0)),
    "presence_penalty": ("presence_penalty", wire(float, 0.0, ge=-2.0, le=2.0)),
    "frequency_penalty": ("frequency_penalty", wire(float, 0.0, ge=-2.0, le=2.0)),
    "seed": ("seed", wire(int | None, None, ge=SEED_MIN, le=SEED_MAX)),
    "min_tokens": ("min_tokens", wire(int, 0, ge=0)),
    "stop": ("stop", as_list, wire(str | list[str] | None)),
    "stop_token_ids": ("stop_token_ids", as_list, wire(list[int] | None, items={"ge": 0})),
    "ignore_eos": ("ignore_eos", wire(bool, False)),
    "skip_special_tokens": ("skip_special_tokens", wire(bool, True)),
    "include_stop_str_in_output": ("include_stop_str_in_output", wire(bool, False)),
    "truncate_prompt_tokens": ("truncate_prompt_tokens", wire(
        int | None, None, "keep the prompt's last k tokens (-1: what the context holds)")),
})

# vLLM's older /generate body: SamplingParams' own field names, each unchanged.
SAMPLING_PARAMS: Translation = table("SamplingParams", {f.name: f.name for f in dataclasses.fields(SamplingParams)})

# PagedLLM / ChatPaged constructor fields and per-call options (langchain/options.py's PagedOptions, whose
# fields for these options are generated from the rows). Their stop strings are the union of the
# constructor's and the call's before they are translated.
LANGCHAIN: Translation = table("LangChain", {
    "temperature": ("temperature", wire(float, defaults.LANGCHAIN["temperature"])),
    "top_p": ("top_p", wire(float, 1.0)),
    "top_k": ("top_k", wire(int, 0)),
    "min_p": ("min_p", wire(float, 0.0)),
    "repetition_penalty": ("repetition_penalty", wire(float, 1.0)),
    "presence_penalty": ("presence_penalty", wire(float, 0.0)),
    "frequency_penalty": ("frequency_penalty", wire(float, 0.0)),
    "seed": ("seed", wire(int | None)),
    "max_tokens": ("max_tokens", wire(int | None, defaults.LANGCHAIN["max_tokens"])),
    "min_tokens": ("min_tokens", wire(int, 0)),
    "n": ("n", wire(int, 1)),
    "best_of": ("best_of", wire(int | None, None, (
        "Sample this many and keep the n with the best log probability per token (not with streaming)."))),
    "structured_outputs": ("structured_outputs", wire(dict[str, Any] | None, None, (
        'Hold every answer to a shape, in vLLM\'s vocabulary: {"json": schema}, {"json_object": True}, '
        '{"regex": ...}, {"choice": [...]} or {"grammar": EBNF}, optionally with "disable_any_whitespace".'))),
    "stop": ("stop", as_list, wire(list[str] | None, None, (
        "Stop strings; a call's `stop` is added to these, and the text is cut before the match."))),
    "truncate_prompt_tokens": ("truncate_prompt_tokens", wire(int | None, None, (
        "Answer from the prompt's last k tokens only (-1: as many as the engine's context holds)."))),
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
