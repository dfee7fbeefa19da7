"""LangChain messages -> the role/content dicts that HF chat templates render.

Consecutive messages of one role are merged (many templates reject or garble two system or two
user turns in a row); tool results stay separate, since each answers its own call.
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from paged_backend.image_sources import is_image_part

# Blocks that describe something the template renders from elsewhere (tool_calls) or cannot render.
SKIPPED_AI_BLOCKS = {"tool_use", "tool_call", "function_call"}


def to_chat_dicts(messages: list[BaseMessage], images: bool = False) -> list[dict[str, Any]]:
    """`images`: the engine takes image blocks of human messages (else they are refused)."""
    conversation: list[dict[str, Any]] = []
    for message in messages:
        entry = to_chat_dict(message, images)
        previous = conversation[-1] if conversation else None
        if previous and previous["role"] == entry["role"] and entry["role"] != "tool":
            merge_into(previous, entry)
        else:
            conversation.append(entry)
    return conversation


def to_chat_dict(message: BaseMessage, images: bool = False) -> dict[str, Any]:
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text_of(message)}
    if isinstance(message, HumanMessage):
        has_images = images and not isinstance(message.content, str) and any(map(is_image_part, message.content))
        return {"role": "user", "content": parts_of(message) if has_images else text_of(message)}
    if isinstance(message, AIMessage):
        entry: dict[str, Any] = {"role": "assistant", "content": text_of(message)}
        if message.tool_calls:
            entry["tool_calls"] = [to_template_call(c) for c in message.tool_calls]
        return entry
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": text_of(message), "tool_call_id": message.tool_call_id,
                "name": message.name}
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": text_of(message)}
    raise NotImplementedError(f"{type(message).__name__} messages")


def to_template_call(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": call.get("id"), "type": "function", "function": {"name": call["name"], "arguments": call["args"]}}


def merge_into(previous: dict[str, Any], entry: dict[str, Any]) -> None:
    if isinstance(previous["content"], list) or isinstance(entry["content"], list):  # parts with images
        previous["content"] = as_parts(previous["content"]) + as_parts(entry["content"])
    else:
        previous["content"] = "\n\n".join(c for c in (previous["content"], entry["content"]) if c)
    if entry.get("tool_calls"):
        previous["tool_calls"] = previous.get("tool_calls", []) + entry["tool_calls"]


def as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}] if content else []


def parts_of(message: HumanMessage) -> list[dict[str, Any]]:
    """A human message with images as chat parts: its image blocks as they are (the renderer reads LangChain's
    shapes), the rest as text parts."""
    return [block if is_image_part(block) else {"type": "text", "text": text_of(HumanMessage([block]))}
            for block in message.content]


def text_of(message: BaseMessage) -> str:
    """The message's text; a block this text-only path cannot carry (an image, audio) is refused."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        elif block.get("type") == "json":
            parts.append(json.dumps(block["json"]))
        elif not (isinstance(message, AIMessage) and block.get("type") in SKIPPED_AI_BLOCKS):
            raise NotImplementedError(f"{block.get('type')!r} content blocks (ChatPaged is text only)")
    return "".join(parts)
