"""Hermes-style tool calls: the model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls` splits a finished answer into content and calls. `ToolCallStreamer` lets a stream
send content as it comes while holding back anything from the first `<tool_call>` on, so a client
never sees half a call as text; the calls are parsed when the answer is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# A closed block, or an unclosed last one (a model may stop at end-of-turn before writing the close tag).
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls). Text with no well-formed call is all content, so nothing is lost."""
    if OPEN_TAG not in text:
        return text, []
    calls = [parse_call(match.group(1)) for match in BLOCK.finditer(text)]
    if not calls or any(call is None for call in calls):
        return text, []
    content = BLOCK.sub("", text).strip()
    return content or None, calls


def parse_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = parse_json_text(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_json_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


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
        start = self.text.find(OPEN_TAG, self.sent)
        if start >= 0:
            self.in_call = True
            return self.release(start)
        return self.release(len(self.text) - partial_tag_length(self.text))

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


def partial_tag_length(text: str) -> int:
    """Length of the longest suffix of text that could be the start of `<tool_call>`."""
    for size in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0
