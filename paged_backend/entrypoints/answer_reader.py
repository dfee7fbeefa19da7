"""What an assistant turn's text becomes: reasoning (when the model thinks), then content and tool calls.

`AnswerReader` is fixed per turn (`chat_turn.build_chat_turn` makes it): the reasoning parser and whether
the prompt opened the thinking, the tool-call format, the tools and whether a call was forced. The
thinking is split off first, so tool calls and structured outputs see the answer only; a whole answer
(`AnswerReader.split`) and a stream (`AnswerStream`) go through the same parsers and split alike. The
front ends differ only in the shape they give the parts.

Streaming policy: reasoning and content stream as they come, anything from where the calls begin is
held back; a forced call (held to the tools' grammar) streams its name and arguments as they are
written, since it is a call from its first token; a free call is sent whole once the answer is
complete, as only then is it known to be a valid call (an invalid one is content, never a half-sent
call). A forced answer cut off by max_tokens (`cut_off`) keeps its calls as they streamed, the one cut
short included (marked incomplete), whole or streamed alike: a client must not run a call whose
arguments were never finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .reasoning import ReasoningParser
from .tool_calls import ToolParser
from .tool_calls.answer_calls import ToolCall, ToolCallStreamer, cut_tool_calls, parse_tool_calls
from .tool_calls.base import CallDelta


@dataclass(frozen=True, slots=True)
class AnswerReader:
    reasoning: ReasoningParser | None = None  # None: the answer is not split into thinking and content
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
        """What a forced call's grammar leaves out of the text (`ToolParser.forced_prefix`)."""
        return self.tool_parser.forced_prefix if self.forced and self.tool_parser else ""

    def text_of(self, completion: Any, text: str) -> str:
        """`text` (the answer, or its last delta) less the EOS that ended it, if it was decoded."""
        if completion.finish_reason == "stop" and completion.stop_reason is None:
            for eos in self.eos_texts:
                if text.endswith(eos):
                    return text[:-len(eos)]
        return text

    def answer_of(self, completion: Any) -> str:
        return self.text_of(completion, completion.text)

    def delta_of(self, output: Any) -> str:
        """A streamed output's new text (less the EOS on its last delta)."""
        return self.text_of(output.outputs[0], output.delta_text) if output.finished else output.delta_text

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """(reasoning, the rest) of a finished answer; reasoning is None when the answer is not split."""
        return self.reasoning.split(text, self.opened) if self.reasoning else (None, text)

    def split(self, text: str, cut: bool = False) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a finished answer; `cut`: max_tokens ended it (`cut_off`)."""
        reasoning, content = self.split_reasoning(text)
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            read = cut_tool_calls if self.forced and cut else parse_tool_calls
            content, calls = read(content, self.tool_parser, self.tools, self.prefix)
            calls = calls if self.parallel else calls[:1]
        if reasoning is not None and not content:
            content = None
        return reasoning, content, calls

    def reasoning_tokens(self, tokenizer: Any, token_ids: list[int]) -> int:
        return self.reasoning.reasoning_tokens(tokenizer, token_ids, self.opened) if self.reasoning else 0

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


def cut_off(completion: Any) -> bool:
    """Whether max_tokens ended the answer."""
    return completion.finish_reason == "length"


@dataclass(slots=True)
class Pieces:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)  # pieces of forced calls, as they are written
    tool_calls: list[ToolCall] = field(default_factory=list)  # on finish: every call of the answer
    streamed: int = 0  # on finish: how many of `tool_calls` went out as pieces (the rest go whole)

    @property
    def unsent_calls(self) -> list[ToolCall]:
        return self.tool_calls[self.streamed:]


class AnswerStream:
    """One streamed answer: `push` gives the pieces safe to send now, `finish` the rest."""

    def __init__(self, reader: AnswerReader) -> None:
        self.reader = reader
        self.thinking = reader.reasoning.stream(reader.opened) if reader.reasoning else None
        self.tools = (ToolCallStreamer(reader.tool_parser, reader.tools, reader.prefix)
                      if reader.tool_parser else None)

    def push(self, delta: str) -> Pieces:
        pieces = Pieces()
        if self.thinking is not None:
            split = self.thinking.push(delta)
            pieces.reasoning, delta = split.reasoning, split.content
        pieces.content = self.tools.push(delta) if self.tools else delta
        if self.reader.forced:  # held to the grammar, so a call from its first token: stream it as written
            pieces.calls = self.tools.stream.deltas()
        return pieces

    def finish(self, cut: bool = False) -> Pieces:
        """The rest of the answer; `cut`: max_tokens ended it (`cut_off`)."""
        pieces = Pieces()
        if self.thinking is not None:
            split = self.thinking.finish()
            pieces.reasoning = split.reasoning
            pieces.content = self.tools.push(split.content) if self.tools else split.content
        if self.tools is None:
            return pieces
        forced = self.reader.forced
        late = self.tools.stream.deltas() if forced else []
        streamed = self.tools.stream.calls.streamed if forced else 0
        rest, calls = ("", self.tools.finish_cut()) if forced and cut else self.tools.finish()
        pieces.tool_calls = calls if self.reader.parallel else calls[:1]
        pieces.streamed = min(streamed, len(pieces.tool_calls))
        if streamed:
            pieces.calls = late  # the held-back text was the calls, already sent as such
        else:
            pieces.content += rest
        return pieces
