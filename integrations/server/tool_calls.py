"""Hermes-style tool calls: the model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls` splits a finished answer into content and calls. `ToolCallStreamer` lets a stream
send content as it comes while holding back anything from the first `<tool_call>` on, so a client
never sees half a call as text; the calls are parsed when the answer is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..hermes import BLOCK, OPEN, HermesCall, content_so_far, new_call_id, split_calls


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls). Text with no well-formed call is all content, so nothing is lost."""
    if OPEN not in text:
        return text, []
    content, calls = split_calls(text)
    if not calls or not all(call.valid for call in calls):
        return text, []
    return content or None, [to_tool_call(call) for call in calls]


def to_tool_call(call: HermesCall) -> ToolCall:
    return ToolCall(call.name, json.dumps(call.arguments, ensure_ascii=False), new_call_id())


class ToolCallStreamer:
    """Feeds streamed text; `push` returns the content that is safe to send now."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.in_call = False

    def push(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        self.in_call = OPEN in self.text
        return self.release(len(content_so_far(self.text)))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the answer is complete."""
        _, calls = parse_tool_calls(self.text)
        if calls:  # the content before the first call is already sent; what is left is text between calls
            return BLOCK.sub("", self.text[self.sent:]).strip(), calls
        return self.release(len(self.text)), []

    def release(self, end: int) -> str:
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece
