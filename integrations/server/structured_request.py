"""Which structured output a request asks for, from whichever field it uses: vLLM's
`structured_outputs` or its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`,
and for chat OpenAI's `response_format` and a forced `tool_choice`. At most one may be given; a
malformed one is a 400 naming its field. The engine then holds the answer to it token by token, so
structured answers stream, score logprobs and fan out to n choices like any other."""

from __future__ import annotations

from typing import Any

from paged_backend.sampling.structured_outputs import StructuredOutputsParams

from paged_backend.entrypoints.structured import chosen_tool_name, forced_tool_spec, response_format_spec
from .errors import bad_request
from .protocol import ChatCompletionRequest, SamplingFields

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_spec(body: SamplingFields, tools: list[dict[str, Any]] | None = None,
                    tool_parser: Any = None) -> StructuredOutputsParams | None:
    """The request's one structured-output spec, or None; 400 for two of them or a malformed one. A forced
    call is written in `tool_parser`'s format (Hermes when None)."""
    if isinstance(body, ChatCompletionRequest) and body.forces_tool:
        try:
            chosen_tool_name(tools or [], body.tool_choice)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from None
    asked = [(field, spec) for field, spec in specs_of(body, tools, tool_parser) if spec is not None]
    if len(asked) > 1:
        raise bad_request(f"give at most one structured output; got {[field for field, _ in asked]}", asked[1][0])
    if not asked:
        return None
    field, make = asked[0]
    try:
        return make()
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), field) from None


def specs_of(body: SamplingFields, tools: list[dict[str, Any]] | None, tool_parser: Any = None):
    """(field, a callable building its spec) for each field the request set (None where unset)."""
    yield "structured_outputs", (None if body.structured_outputs is None
                                 else lambda: StructuredOutputsParams.of(body.structured_outputs))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field)
        yield field, None if value is None else (lambda kind=kind, value=value: StructuredOutputsParams.of({kind: value}))
    if isinstance(body, ChatCompletionRequest):
        if body.forces_tool:
            yield "tools", lambda: forced_tool_spec(tools or [], body.tool_choice, body.parallel_tool_calls, tool_parser)
        if body.wants_json:
            yield "response_format", lambda: response_format_spec(body.response_format.model_dump())
