"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block
per call, possibly between text (the tags live in tool_call_tags.py)."""

from __future__ import annotations

import json
from typing import Any

from .tool_call_tags import BLOCK, CLOSE, OPEN, partial_open
from .base import ParsedAnswer, PartialCall, ToolParser, Tools
from .grammar import arguments_grammar
from .json_calls import Piece, parse_object, partial_object


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN, CLOSE)

    def calls_start(self, text: str) -> int | None:
        at = text.find(OPEN)
        return None if at < 0 else at

    def held_back(self, text: str) -> int:
        return partial_open(text)

    def parse(self, text: str, tools: Tools | None = None) -> ParsedAnswer:
        if OPEN not in text:
            return ParsedAnswer(text)
        return ParsedAnswer(BLOCK.sub("", text).strip(), [parse_object(body) for body in BLOCK.findall(text)])

    def partial(self, region: str, tools: Tools | None = None) -> list[PartialCall]:
        calls = []
        for match in BLOCK.finditer(region):
            closed = match.group(0).endswith(CLOSE)
            call = partial_object(Piece(match.group(1), closed))
            if call is None:
                break
            calls.append(call)
            if not closed:
                break
        return calls

    def forced_format(self, tools: Tools, single: bool) -> Any:
        from xgrammar.structural_tag import (
            GrammarFormat,
            TagFormat,
            TagsWithSeparatorFormat,
        )

        tags = [TagFormat(begin=f'{OPEN}\n{{"name": {json.dumps(tool["function"]["name"])}, "arguments": ',
                          content=GrammarFormat(grammar=arguments_grammar(tool["function"])), end=f"}}\n{CLOSE}")
                for tool in tools]
        return TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=single)

