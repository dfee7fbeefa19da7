"""What a chat answer's text becomes: reasoning (when the model thinks), then content and tool calls.

`AnswerPlan` is fixed per request: the reasoning parser and whether the prompt opened the thinking,
the tool-call format, the tools and whether a call was forced. The thinking is split off first, so
tool calls and structured outputs see the answer only; a plain answer (`split`) and a stream
(`AnswerStream`) go through the same parsers and split alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..hermes import CallDelta, new_call_id
from ..reasoning import ReasoningParser, ReasoningStream, reasoning_tokens
from ..tool_parsers import ToolParser
from .tool_calls import ToolCall, ToolCallStreamer, parse_tool_calls


@dataclass(slots=True)
class AnswerPlan:
    reasoning: ReasoningParser | None = None
    opened: bool = False  # the prompt left the thinking open
    tool_parser: ToolParser | None = None  # None: no tools in play
    tools: list[dict[str, Any]] | None = None
    forced: bool = False  # a call forced by the grammar (tool_choice required or named)
    parallel: bool = True
    # The text of the end-of-sequence tokens, when special tokens are kept for the markers' sake: the
    # engine then decodes the EOS that ended the answer too, which is no part of it.
    eos_texts: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return self.tool_parser.forced_prefix if self.forced and self.tool_parser else ""

    def text_of(self, completion: Any, text: str) -> str:
        """`text` (the answer, or its last delta) less the EOS that ended it, if it was decoded."""
        if completion.finish_reason == "stop" and completion.stop_reason is None:
            for eos in self.eos_texts:
                if text.endswith(eos):
                    return text[:-len(eos)]
        return text

    def split(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a finished answer."""
        reasoning, content = self.reasoning.split(text, self.opened) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            content, calls = parse_tool_calls(content, self.tool_parser, self.tools, self.prefix)
            calls = calls if self.parallel else calls[:1]
        if reasoning is not None and not content:
            content = None
        return reasoning, content, calls

    def reasoning_tokens(self, tokenizer: Any, token_ids: list[int]) -> int:
        return reasoning_tokens(tokenizer, self.reasoning, token_ids, self.opened) if self.reasoning else 0

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


@dataclass(slots=True)
class Pieces:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's streamed call pieces
    called: bool = False  # the answer ended in calls (finish_reason "tool_calls")


class AnswerStream:
    """One streamed choice: `push` gives the pieces safe to send now, `finish` the rest."""

    def __init__(self, plan: AnswerPlan) -> None:
        self.plan = plan
        self.thinking = ReasoningStream(plan.reasoning, plan.opened) if plan.reasoning else None
        self.tools = ToolCallStreamer(plan.tool_parser, plan.tools, plan.prefix) if plan.tool_parser else None

    def push(self, delta: str) -> Pieces:
        pieces = Pieces()
        if self.thinking is not None:
            split = self.thinking.push(delta)
            pieces.reasoning, delta = split.reasoning, split.content
        pieces.content = self.tools.push(delta) if self.tools else delta
        if self.plan.forced:  # held to the grammar, so a call from its first token: stream it as written
            pieces.calls = [call_piece(d) for d in self.tools.stream.deltas()]
        return pieces

    def finish(self) -> Pieces:
        pieces = Pieces()
        if self.thinking is not None:
            split = self.thinking.finish()
            pieces.reasoning = split.reasoning
            pieces.content = self.tools.push(split.content) if self.tools else split.content
        if self.tools is None:
            return pieces
        streamed = self.tools.stream.calls.streamed
        late = [call_piece(d) for d in self.tools.stream.deltas()] if self.plan.forced else []
        rest, calls = self.tools.finish()
        calls = calls if self.plan.parallel else calls[:1]
        if self.plan.forced and (streamed or late):
            pieces.calls = late  # the held-back text was the calls, already sent as such
        else:
            pieces.content += rest
            pieces.calls = [dict(call.to_openai(), index=k) for k, call in enumerate(calls)]
        pieces.called = bool(calls)
        return pieces


def call_piece(delta: CallDelta) -> dict[str, Any]:
    """OpenAI's shape of a streamed call piece: the first carries the call's id, type and name."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": new_call_id(), "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}
