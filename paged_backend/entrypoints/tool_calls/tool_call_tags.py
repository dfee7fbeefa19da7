"""The `<tool_call>` tags that Hermes / Qwen2.5 / Qwen3 answers wrap each call in (hermes.py's JSON body,
qwen3_coder.py's XML body): the tags, a block's text, and how much of a streamed answer's end may still become
a tag."""

from __future__ import annotations

import re

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
