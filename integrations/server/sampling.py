"""Turn a validated request into engine SamplingParams, and check it against the context length."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from paged_backend.core.request import LogitsProcessor
from paged_backend.entrypoints.engine_client import EngineClient
from paged_backend.errors import ContextLengthError, check_context
from paged_backend.integrations.options.translation import Translation
from paged_backend.integrations.options.vocabularies import OPENAI, SEED_MAX, SEED_MIN
from paged_backend.sampling.sampling_params import SamplingParams
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

from .errors import APIError, bad_request
from .protocol import SamplingFields


def to_sampling_params(request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                       structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """One choice's parameters, through the OpenAI vocabulary's table; `with_choices` sets n."""
    options = {name: getattr(request, name) for name in OPENAI.names}
    return build_params(OPENAI, options, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured)


def build_params(vocabulary: Translation, options: dict[str, Any], **fields: Any) -> SamplingParams:
    """SamplingParams from `options` (named in `vocabulary`) and `fields` (named as SamplingParams), with any
    error its checks raise (its ValueErrors name the field) turned into a 400."""
    check_seed(options.get("seed", fields.get("seed")))
    try:
        return vocabulary.params(options, **fields)
    except Exception as exc:  # noqa: BLE001  (built from the request alone: whatever fails, the input did)
        raise bad_request(str(exc), param=field_named_in(str(exc))) from None


def check_seed(seed: object) -> None:
    """A seed must fit the engine's generator even for a request's last sample (seeded seed + i)."""
    if isinstance(seed, int) and not SEED_MIN <= seed <= SEED_MAX:
        raise bad_request(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {seed}", "seed")


PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def field_named_in(message: str) -> str | None:
    """The SamplingParams field an error message starts with ("SamplingParams.top_k=...", "stop must ...")."""
    match = re.match(r"(?:SamplingParams\.)?([a-z_]+)", message)
    return match.group(1) if match and match.group(1) in PARAM_FIELDS else None


def with_choices(params: SamplingParams, n: int, best_of: int | None = None) -> SamplingParams:
    """The n choices of one prompt as one engine request with n samples (sample i is seeded seed + i);
    with best_of, the engine samples best_of times and keeps the n best."""
    return dataclasses.replace(params, n=n, best_of=best_of)


def bias_processor(client: EngineClient, logit_bias: dict[str, float] | None) -> LogitsProcessor | None:
    """OpenAI's logit_bias as a per-request logits processor: each listed token's logit moves by its bias
    (100 all but forces it, -100 all but bans it). A token outside the vocabulary is a 400."""
    if not logit_bias:
        return None
    ids = [int(key) for key in logit_bias]
    outside = [i for i in ids if i >= client.vocab_size]
    if outside:
        raise bad_request(f"logit_bias names token ids {outside[:5]} outside the vocabulary [0, {client.vocab_size})",
                          "logit_bias")
    index, bias = torch.tensor(ids), torch.tensor(list(logit_bias.values()))

    def add_bias(_output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        row[index.to(row.device)] += bias.to(row.device, row.dtype)
        return row

    return add_bias


def then(first: LogitsProcessor | None, second: LogitsProcessor | None) -> LogitsProcessor | None:
    """Both processors, `first` applied first (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda output_ids, row: second(output_ids, first(output_ids, row))


def check_prompt(client: EngineClient, token_ids: list[int], params: SamplingParams, what: str = "prompt") -> list[int]:
    """Refuse (400) a prompt that, with its max_tokens, does not fit the context, giving the numbers; else
    return the tokens the engine will run (truncate_prompt_tokens applied), which usage counts. The server
    reserves max_tokens, as OpenAI's API does, where the engine alone would clip it to the room left."""
    token_ids = params.kept_prompt(token_ids, client.max_model_len)
    try:
        check_context(client.max_model_len, len(token_ids), params.max_tokens or 1, what=what)
        client.validate(token_ids, params)
    except ContextLengthError as exc:
        raise context_refusal(exc.naming(what)) from None
    except ValueError as exc:
        raise bad_request(str(exc), param=field_named_in(str(exc))) from None
    return token_ids


def context_refusal(exc: ContextLengthError, param: str | None = None) -> APIError:
    """The 400 for a prompt past the context: OpenAI's code, naming the request's field for the prompt."""
    return APIError(400, str(exc), param or ("messages" if exc.what == "messages" else "prompt"),
                    "context_length_exceeded")
