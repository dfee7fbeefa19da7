"""A chat route's turn: the shared chat turn (`paged_backend/entrypoints/chat_turn.py`) on the server's
reasoning parser, tool-call format and context check, its refusals as 400s naming the route's own fields
(`TurnFields`: /v1/responses calls the conversation `input`, /v1/messages the budget `thinking`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_backend.entrypoints.chat import ChatInputError, Message, UnsupportedContent
from paged_backend.entrypoints.chat_turn import ChatTurn, ChatTurnError, NeedsReasoningModel, build_chat_turn
from paged_backend.entrypoints.structured import ToolSchemaError, check_tool_schemas
from paged_backend.sampling.sampling_params import SamplingParams

from .errors import APIError, bad_request, not_supported, request_field
from .sampling import check_prompt
from .state import ServerState


@dataclass(frozen=True, slots=True)
class TurnFields:
    """The route's names for the turn's inputs, which its 400s name."""

    messages: str = "messages"
    tools: str = "tools"
    response_format: str = "response_format"
    thinking_budget: str = "thinking_token_budget"
    # Parts refused in `request_field`'s words ("tools could not be read: ..."), as these routes read them.
    read: frozenset[str] = field(default_factory=frozenset)

    def name_of(self, part: str) -> str:
        return {"tools": self.tools, "response_format": self.response_format,
                "thinking_budget": self.thinking_budget}[part]


def route_turn(state: ServerState, messages: list[Message], params: SamplingParams, fields: TurnFields,
               **inputs: Any) -> ChatTurn:
    """The turn of `messages` (`inputs`: build_chat_turn's tools, tool_choice, response_format, ...)."""
    if state.tokenizer is None or not getattr(state.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")

    def fits(prompt_ids: list[int], final: SamplingParams) -> list[int]:
        try:
            return check_prompt(state.client, prompt_ids, final, "messages")
        except APIError as exc:
            if exc.param == "messages":  # the route's own name for its conversation
                exc.param = fields.messages
            raise

    with request_field(fields.messages):
        try:
            return build_chat_turn(state.tokenizer, messages, params, reasoning=state.reasoning_parser,
                                   tool_parser=state.tool_parser, eos_token_ids=state.client.eos_token_ids,
                                   check_prompt=fits, image_prompts=state.client.image_prompts, **inputs)
        except UnsupportedContent as exc:
            raise not_supported(exc.field, "text-only model") from None
        except ChatInputError as exc:
            raise bad_request(str(exc), exc.field) from None
        except ChatTurnError as exc:
            raise refusal(exc, fields) from None


def refusal(exc: ChatTurnError, fields: TurnFields) -> APIError:
    param = fields.name_of(exc.part)
    if isinstance(exc, NeedsReasoningModel):
        return bad_request(f"{param} needs a reasoning model: this server runs no reasoning parser "
                           "(--reasoning-parser)", param)
    if exc.part in fields.read:
        return bad_request(f"{param} could not be read: {type(exc.cause).__name__}: {exc.cause}", param)
    return bad_request(str(exc), param)


def check_tools(tools: list[dict[str, Any]] | None, schema_field: str) -> None:
    """400 naming `schema_field` (the route's name of a tool's schema, formatted with the tool's index)
    for the first tool whose schema is broken, forced or not."""
    try:
        check_tool_schemas(tools)
    except ToolSchemaError as exc:
        field_name = schema_field.format(exc.index)
        raise bad_request(f"{field_name} (tool {exc.name!r}) is not a valid JSON schema: {exc.reason}",
                          field_name) from None
