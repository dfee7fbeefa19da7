"""What every tool-call format provides, and what the front ends do with any of them.

A `ToolParser` knows one family's markup: where the calls begin in an answer (`calls_start`), how
much of a streamed answer's end may still become that beginning (`held_back`), the finished answer's
content and calls (`parse`), the calls written so far as name + argument text for streaming
(`partial`), and the xgrammar format that holds a forced call to the tools' schemas (`forced_format`).
Front ends use the functions below and never a format's internals.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

Tools = list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # which call of the answer, from 0
    name: str | None  # on a call's first delta only
    arguments: str  # the next piece of the arguments' JSON text


def new_call_id() -> str:
    """A fresh id for a parsed call, in OpenAI's `call_...` form."""
    return f"call_{uuid.uuid4().hex[:24]}"



@dataclass(frozen=True, slots=True)
class ParsedCall:
    body: str  # the call's text as written, stripped
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None  # why the text is not a valid call; None when it is

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(slots=True)
class ParsedAnswer:
    content: str  # the text outside the calls, stripped
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def all_valid(self) -> bool:
        return bool(self.calls) and all(call.valid for call in self.calls)


@dataclass(frozen=True, slots=True)
class PartialCall:
    name: str
    arguments: str  # the arguments' JSON text so far; each later value extends it
    closed: bool


class ToolParser(ABC):
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # texts that must survive decoding (see `keeps_special_tokens`)
    forced_prefix: ClassVar[str] = ""  # what a forced call's grammar leaves out; prepended before parsing

    @abstractmethod
    def calls_start(self, text: str) -> int | None:
        """Where the calls begin in `text`, or None while none has (yet)."""

    @abstractmethod
    def held_back(self, text: str) -> int:
        """Length of the end of `text` (with no calls yet) that may still become their beginning."""

    @abstractmethod
    def parse(self, text: str, tools: Tools | None = None) -> ParsedAnswer:
        """The finished answer's content and calls (a call that does not parse is one with an error)."""

    @abstractmethod
    def partial(self, region: str, tools: Tools | None = None) -> list[PartialCall]:
        """The calls in `region` (the text from `calls_start` on) whose name is known, in order; a
        call that cannot stream ends the list (the final parse has it)."""

    @abstractmethod
    def forced_format(self, tools: Tools, single: bool) -> Any:
        """The xgrammar structural-tag format of one call (`single`) or one or more of `tools`."""


def content_so_far(parser: ToolParser, text: str) -> str:
    """The part of a streamed answer that is certainly content: before the calls, less what may begin them."""
    start = parser.calls_start(text)
    if start is not None:
        return text[:start]
    return text[:len(text) - parser.held_back(text)]


def suffix_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class CallDeltas:
    """Turns successive `partial` lists into OpenAI-style deltas: a call's name once, then each new
    piece of its argument text."""

    def __init__(self) -> None:
        self.sent: list[int] = []  # per call: characters of its arguments sent

    def update(self, calls: list[PartialCall]) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        for index, call in enumerate(calls):
            if index == len(self.sent):
                self.sent.append(0)
                deltas.append(CallDelta(index, call.name, ""))
            if len(call.arguments) > self.sent[index]:
                deltas.append(CallDelta(index, None, call.arguments[self.sent[index]:]))
                self.sent[index] = len(call.arguments)
        return deltas

    @property
    def streamed(self) -> int:
        return len(self.sent)


class ToolCallStream:
    """One streamed answer under one format: `push` returns the content safe to send now; `deltas`
    the call pieces the text so far adds; `finish` the parsed answer."""

    def __init__(self, parser: ToolParser, tools: Tools | None = None, prefix: str = "") -> None:
        self.parser, self.tools = parser, tools
        self.text = prefix
        self.sent = len(prefix)  # a forced call's prefix is never content
        self.calls = CallDeltas()

    def push(self, delta: str) -> str:
        self.text += delta
        end = len(content_so_far(self.parser, self.text))
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece

    def deltas(self) -> list[CallDelta]:
        start = self.parser.calls_start(self.text)
        if start is None:
            return []
        return self.calls.update(self.parser.partial(self.text[start:], self.tools))

    def finish(self) -> ParsedAnswer:
        return self.parser.parse(self.text, self.tools)

    def unsent(self) -> str:
        """The text not sent as content yet."""
        return self.text[self.sent:]


def keeps_special_tokens(tokenizer: Any, markers: tuple[str, ...]) -> bool:
    """Whether some marker is a special token of `tokenizer`, which decoding would drop unless told
    to keep special tokens (Mistral's [TOOL_CALLS] is one)."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {str(token) for token in decoder.values() if getattr(token, "special", False)}
    return any(marker in special for marker in markers)
