"""An assistant turn's text split into (reasoning, content, tool calls): the one place every chat-shaped
route (`/v1/responses`, `/v1/messages`) reads a generation through, finished or streamed.

Tool calls are the Hermes `<tool_call>` blocks (`tool_calls.py`). The model's thinking, for models that
write it between markers, belongs here too: `reasoning` stays None until a reasoning parser is chosen
for the model, and that parser plugs in at `split_answer` and `AnswerStream.push` / `finish`.

Streaming policy (the chat route's): content streams as it comes, anything from the first call tag on
is held back; a forced call (`tool_choice` required or named, held to the tools' grammar) streams its
name and arguments as they are written, since it is a call from its first token; a free call is sent
whole once the answer is complete, as only then is it known to be a valid call (an invalid block is
content, never a half-sent call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hermes import CallDelta, CallStream
from .tool_calls import ToolCall, ToolCallStreamer, parse_tool_calls


@dataclass(slots=True)
class Answer:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def split_answer(text: str, uses_tools: bool, parallel_tool_calls: bool = True) -> Answer:
    """A finished generation's parts; without tools every character is content."""
    if not uses_tools:
        return Answer(None, text, [])
    content, calls = parse_tool_calls(text)
    return Answer(None, content, calls if parallel_tool_calls else calls[:1])


@dataclass(slots=True)
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)  # pieces of forced calls, as they are written


class AnswerStream:
    """Feed a generation's text deltas; get what may be sent now, and the whole answer at the end."""

    def __init__(self, uses_tools: bool, forces_tool: bool = False, parallel_tool_calls: bool = True) -> None:
        self.streamer = ToolCallStreamer() if uses_tools else None
        self.calls = CallStream() if forces_tool else None
        self.parallel = parallel_tool_calls
        self.text = ""

    def push(self, delta: str) -> AnswerDelta:
        self.text += delta
        if self.streamer is None:
            return AnswerDelta(content=delta)
        content = self.streamer.push(delta)
        return AnswerDelta(content=content, calls=self.calls.update(self.streamer.text) if self.calls else [])

    def finish(self) -> tuple[AnswerDelta, Answer]:
        """(what was still held back, the whole answer). Calls that streamed are not repeated as deltas
        beyond their last pieces; the answer lists every call, streamed or not."""
        if self.streamer is None:
            return AnswerDelta(), Answer(None, self.text, [])
        rest, calls = self.streamer.finish()
        calls = calls if self.parallel else calls[:1]
        pieces: list[CallDelta] = []
        if self.calls is not None and self.calls.streamed:
            pieces = [d for d in self.calls.update(self.streamer.text) if d.index < len(calls)]
            rest = ""  # the held-back text was the calls, already sent as such
        content = split_answer(self.text, True, self.parallel).content if calls else self.text
        return AnswerDelta(content=rest, calls=pieces), Answer(None, content, calls)

    @property
    def streamed_calls(self) -> int:
        """How many forced calls have started streaming (0: calls, if any, come whole at the end)."""
        return self.calls.streamed if self.calls is not None else 0
