"""Hermes/Qwen-style tool calls, as models trained that way write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several, possibly between text.

The primitives behind the Hermes format of `tool_parsers/` (which the server and LangChain use):
the tags, block splitting, `CallStream.arguments_so_far` (a name-first call's argument text as it is
written, which every JSON format's streaming shares), `content_so_far` and `new_call_id`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A closed block, or an unclosed last one (a model may stop at end-of-turn, or max_tokens may cut it).
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class HermesCall:
    body: str  # the block's text, stripped
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None  # why the block is not a valid call; None when it is

    @property
    def valid(self) -> bool:
        return self.error is None


def split_calls(text: str) -> tuple[str, list[HermesCall]]:
    """(the text without its call blocks, stripped; each block, parsed)."""
    return BLOCK.sub("", text).strip(), [parse_call(body.strip()) for body in BLOCK.findall(text)]


def parse_call(body: str) -> HermesCall:
    """One block's JSON: a string `name` and an object of `arguments` (or `parameters`), which may
    itself arrive as JSON text."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise TypeError("a call must be a JSON object")
        name, arguments = data["name"], data.get("arguments", data.get("parameters", {}))
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as exc:
        return HermesCall(body, error=f"{type(exc).__name__}: {exc}")
    return HermesCall(body, name, arguments)


def partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the opening tag: streamed text
    that may still become a tag, to hold back."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def content_so_far(text: str) -> str:
    """The part of a streamed answer that is certainly not a call: the text before the first opening
    tag, less a suffix that may still become one."""
    head = text.split(OPEN, 1)[0]
    return head if len(head) < len(text) else head[:len(head) - partial_open(head)]


def new_call_id() -> str:
    """A fresh id for a parsed call, in OpenAI's `call_...` form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_close(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the closing tag."""
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if text.endswith(CLOSE[:n]):
            return n
    return 0


# A block written name first, up to where its arguments begin.
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
TRAILING_BRACES = re.compile(r"[}\s]*\Z")


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # which call of the answer, from 0
    name: str | None  # on a call's first delta only
    arguments: str  # the next piece of the arguments' JSON text


class CallStream:
    """Each block's name and argument text as they are written, for blocks written name first
    (`{"name": ..., "arguments": ...}`: the form the templates teach and the forcing grammar holds to);
    other blocks stream nothing and are left to the final parse. A block's last `}` closes the call,
    not its arguments, so a trailing run of `}` and whitespace (and a partial closing tag) is held
    back until the text goes on or the block closes."""

    def __init__(self) -> None:
        self.sent: list[int] = []  # per block that streams: characters of its arguments sent
        self.closed = 0  # blocks closed (and wholly sent)
        self.offset = 0  # where the first block not yet closed starts: the text before is done with
        self.stopped = False  # a block not written name first: it and the rest go to the final parse

    def update(self, text: str) -> list[CallDelta]:
        """The deltas that the answer's text so far adds."""
        deltas: list[CallDelta] = []
        for match in BLOCK.finditer(text, self.offset):
            body, closed = match.group(1), match.group(0).endswith(CLOSE)
            header = HEADER.match(body)
            if self.stopped or header is None:
                self.stopped = self.stopped or closed  # an open block may still become a header
                break
            index = self.closed
            if index == len(self.sent):
                self.sent.append(0)
                deltas.append(CallDelta(index, json.loads(header.group(1)), ""))
            arguments = self.arguments_so_far(body[header.end():], closed)
            if len(arguments) > self.sent[index]:
                deltas.append(CallDelta(index, None, arguments[self.sent[index]:]))
                self.sent[index] = len(arguments)
            if not closed:
                break
            self.closed, self.offset = self.closed + 1, match.end()
        return deltas

    @staticmethod
    def arguments_so_far(text: str, closed: bool) -> str:
        if closed:
            text = text.rstrip()
            return text[:-1].rstrip() if text.endswith("}") else text
        text = text[:len(text) - partial_close(text)]
        return text[:TRAILING_BRACES.search(text).start()]

    @property
    def streamed(self) -> int:
        """How many calls have started streaming."""
        return len(self.sent)
