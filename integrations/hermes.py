"""Hermes/Qwen-style tool calls, as models trained that way write them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several, possibly between text.

Shared by the server and the LangChain adapter, which differ only in what they do with a block that
is not a valid call (the server keeps the whole answer as text; LangChain reports an invalid call).
"""

from __future__ import annotations

import json
import re
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
