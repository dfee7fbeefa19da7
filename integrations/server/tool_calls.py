"""Tool calls in chat answers, in whichever format the served model writes (`integrations/tool_parsers/`).

`parse_tool_calls` splits a finished answer into content and calls: any call that does not parse
leaves the whole answer as content, so nothing is lost and a malformed call is never an error.
`ToolCallStreamer` lets a stream send content as it comes while holding back anything from where
the calls begin, so a client never sees half a call as text; the calls are parsed when the answer is
complete (or, for a call forced by the grammar, streamed as written: `ToolCallStream.deltas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..hermes import new_call_id
from ..tool_parsers import HERMES, ParsedAnswer, ParsedCall, ToolCallStream, ToolParser


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str

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
