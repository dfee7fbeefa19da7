"""The server's side of chat rendering: the shared renderer (`paged_backend/entrypoints/chat.py`, which holds the
tool policy) with its errors as OpenAI 400s naming the field."""

from __future__ import annotations

from typing import Any

from paged_backend.entrypoints.chat import (
    HERMES_TOOL_PROMPT,
    ChatInputError,
    Message,
    UnsupportedContent,
    add_tool_prompt,
)
from paged_backend.entrypoints.chat import render_chat as render_shared

from .errors import bad_request, not_supported

__all__ = ["HERMES_TOOL_PROMPT", "add_tool_prompt", "render_chat"]


def render_chat(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        return render_shared(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                             template_kwargs=template_kwargs)
    except UnsupportedContent as exc:
        raise not_supported(exc.field, "text-only model") from None
    except ChatInputError as exc:
        raise bad_request(str(exc), exc.field) from None
