"""The `<tool_call>` tags that Hermes / Qwen2.5 / Qwen3 answers wrap each call in (hermes.py's JSON body,
qwen3_coder.py's XML body): the tags, a block's text, how much of a streamed answer's end may still become
a tag, and the parser both formats share, which reads each block's body in its own way."""

from __future__ import annotations

import re
from abc import abstractmethod

from .base import ParsedAnswer, ParsedCall, ToolParser, Tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A closed block, or an unclosed last one (a model may stop at end-of-turn, or max_tokens may cut it).
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the opening tag: streamed text
    that may still become a tag, to hold back."""
    return partial_tag(text, OPEN)


def partial_close(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the closing tag."""
    return partial_tag(text, CLOSE)


def partial_tag(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedCallParser(ToolParser):
    """A format whose calls are `<tool_call>` blocks: its calls start at the first opening tag, a partial tag at
    the end of a stream is held back, and a whole answer is its text with the blocks cut out plus one call per
    block, read by `read_block`."""

    markers = (OPEN, CLOSE)

    def calls_start(self, text: str) -> int | None:
        at = text.find(OPEN)
        return None if at < 0 else at

    def held_back(self, text: str) -> int:
        return partial_open(text)

    def parse(self, text: str, tools: Tools | None = None) -> ParsedAnswer:
        if OPEN not in text:
            return ParsedAnswer(text)
        return ParsedAnswer(BLOCK.sub("", text).strip(), [self.read_block(body, tools) for body in BLOCK.findall(text)])

    @abstractmethod
    def read_block(self, body: str, tools: Tools | None) -> ParsedCall:
        """The call one block's body holds."""
