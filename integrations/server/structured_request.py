"""Which structured output a request asks for, from whichever field it uses: vLLM's
`structured_outputs` or its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`,
and for chat OpenAI's `response_format` and a forced `tool_choice`. At most one may be given; a
malformed one is a 400 naming its field. A chat's response format and forced call are built by its
turn (`chat_turn.py`), which writes the call in the server's tool-call format. The engine then holds the answer to it token by token, so
structured answers stream, score logprobs and fan out to n choices like any other."""

from __future__ import annotations

from typing import Any

from paged_backend.sampling.structured_outputs import StructuredOutputsParams

from paged_backend.entrypoints.structured import chosen_tool_name
from .errors import bad_request
from .protocol import ChatCompletionRequest, SamplingFields

TURN_BUILT = ("tools", "response_format")  # a chat's fields whose spec its turn builds
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_spec(body: SamplingFields, tools: list[dict[str, Any]] | None = None) -> StructuredOutputsParams | None:
    """The request's one structured-output spec, or None; 400 for two of them or a malformed one. None too
    for a chat's response format or forced call, which its turn builds (`TURN_BUILT`)."""
    if isinstance(body, ChatCompletionRequest) and body.forces_tool:
        try:
            chosen_tool_name(tools or [], body.tool_choice)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from None
    asked = [(field, spec) for field, spec in specs_of(body) if spec is not None]
    if len(asked) > 1:
        raise bad_request(f"give at most one structured output; got {[field for field, _ in asked]}", asked[1][0])
    if not asked:
        return None
    field, make = asked[0]
    if field in TURN_BUILT:
        return None
    try:
        return make()
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), field) from None


def specs_of(body: SamplingFields):
    """(field, a callable building its spec, or True for one the chat turn builds) for each field the
    request set (None where unset)."""
    yield "structured_outputs", (None if body.structured_outputs is None
                                 else lambda: StructuredOutputsParams.of(body.structured_outputs))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field)
        yield field, None if value is None else (lambda kind=kind, value=value: StructuredOutputsParams.of({kind: value}))
    if isinstance(body, ChatCompletionRequest):
        yield "tools", body.forces_tool or None
        yield "response_format", body.wants_json or None
