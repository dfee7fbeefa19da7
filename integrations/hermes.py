"""Hermes/Qwen-style tool calls, as models trained that way write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several, possibly between text.

The primitives behind the Hermes format of `tool_parsers/` (which the server and LangChain use):
the tags, `arguments_so_far` (a name-first call's argument text as it is written, which every JSON
format's streaming shares), `content_so_far`, `new_call_id`, and `CallDelta`, the streamed piece of a call.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A closed block, or an unclosed last one (a model may stop at end-of-turn, or max_tokens may cut it).
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


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


TRAILING_BRACES = re.compile(r"[}\s]*\Z")


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # which call of the answer, from 0
    name: str | None  # on a call's first delta only
    arguments: str  # the next piece of the arguments' JSON text


def arguments_so_far(text: str, closed: bool) -> str:
    """A name-first call's argument text as written so far, from where its arguments begin. The call's last `}`
    closes the call, not its arguments, so a trailing run of `}` and whitespace (and a partial closing tag) is
    held back until the text goes on or the call closes."""
    if closed:
        text = text.rstrip()
        return text[:-1].rstrip() if text.endswith("}") else text
    text = text[:len(text) - partial_close(text)]
    return text[:TRAILING_BRACES.search(text).start()]
