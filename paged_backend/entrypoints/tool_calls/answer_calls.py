"""An answer's tool calls as `ToolCall`s (OpenAI's shape), in whichever format the served model writes.

`parse_tool_calls` splits a finished answer into content and calls: any call that does not parse
leaves the whole answer as content, so nothing is lost and a malformed call is never an error.
`ToolCallStreamer` lets a stream send content as it comes while holding back anything from where
the calls begin, so a client never sees half a call as text; the calls are parsed when the answer is
complete (or, for a call forced by the grammar, streamed as written: `ToolCallStream.deltas`).
A forced answer cut off by max_tokens keeps its calls as they streamed (`cut_tool_calls`): each call
written whole, then the one cut short with its arguments as far as they were written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paged_backend.entrypoints.tool_calls.base import new_call_id
from paged_backend.entrypoints.tool_calls import HERMES, ParsedAnswer, ParsedCall, ToolCallStream, ToolParser, content_so_far


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str
    complete: bool = True  # False: cut off by max_tokens, `arguments` as far as they were written

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str, parser: ToolParser = HERMES, tools: list[dict[str, Any]] | None = None,
                     prefix: str = "") -> tuple[str | None, list[ToolCall]]:
    """(content, calls). Text with no well-formed call is all content. `prefix`: what a forced call's
    grammar left out of the text (`ToolParser.forced_prefix`)."""
    return calls_of(parser.parse(prefix + text, tools), text)


def calls_of(parsed: ParsedAnswer, text: str) -> tuple[str | None, list[ToolCall]]:
    if not parsed.all_valid:
        return text, []
    return parsed.content or None, [to_tool_call(call) for call in parsed.calls]


def to_tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(call.name, call.arguments_json, new_call_id())


def cut_tool_calls(text: str, parser: ToolParser = HERMES, tools: list[dict[str, Any]] | None = None,
                   prefix: str = "") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a forced answer cut off by max_tokens, as its stream sent them: the content
    before the calls, and `written_calls`. A stream cannot take back a call it began, so the whole
    answer keeps it too, and never shows a call's markup as content."""
    text = prefix + text
    return content_so_far(parser, text)[len(prefix):].strip() or None, written_calls(parser, text, tools)


def written_calls(parser: ToolParser, text: str, tools: list[dict[str, Any]] | None = None) -> list[ToolCall]:
    """The calls of `text` whose name was written, as they streamed (`ToolParser.partial`): each one
    closed, then the first one not closed (or whose arguments are not an object), marked incomplete."""
    start = parser.calls_start(text)
    if start is None:
        return []
    calls = []
    for call in parser.partial(text[start:], tools):
        arguments = json_object(call.arguments) if call.closed else None
        if arguments is None:
            calls.append(ToolCall(call.name, call.arguments, new_call_id(), complete=False))
            break
        calls.append(ToolCall(call.name, json.dumps(arguments, ensure_ascii=False), new_call_id()))
    return calls


def json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ToolCallStreamer:
    """Feeds streamed text; `push` returns the content that is safe to send now."""

    def __init__(self, parser: ToolParser = HERMES, tools: list[dict[str, Any]] | None = None,
                 prefix: str = "") -> None:
        self.stream = ToolCallStream(parser, tools, prefix)

    @property
    def text(self) -> str:
        return self.stream.text

    def push(self, delta: str) -> str:
        return self.stream.push(delta)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the answer is complete."""
        parsed = self.stream.finish()
        if parsed.all_valid:  # the content before the first call is sent; what is left is text between calls
            sent = self.stream.text[:self.stream.sent]
            rest = parsed.content[len(sent.strip()):] if parsed.content.startswith(sent.strip()) else ""
            return rest.strip(), [to_tool_call(call) for call in parsed.calls]
        rest = self.stream.unsent()
        self.stream.sent = len(self.stream.text)
        return rest, []

    def finish_cut(self) -> list[ToolCall]:
        """The calls of a forced answer cut off by max_tokens (`written_calls`); what was held back is
        the start of a call, never content."""
        self.stream.sent = len(self.stream.text)
        return written_calls(self.stream.parser, self.stream.text, self.stream.tools)
