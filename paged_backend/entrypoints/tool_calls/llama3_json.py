"""Llama 3.1 / 3.2 / 3.3 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (Meta's
format for custom tools), optionally after `<|python_tag|>`, several separated by `;`. An answer
that does not begin with one is plain content."""

from __future__ import annotations

import json
from typing import Any

from .base import ParsedAnswer, ParsedCall, PartialCall, ToolParser, Tools
from .grammar import arguments_grammar
from .json_calls import parse_object, partial_objects, scan_objects

PYTHON_TAG = "<|python_tag|>"
SEPARATORS = ";"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def calls_start(self, text: str) -> int | None:
        head = text.lstrip()
        return 0 if head.startswith((PYTHON_TAG, "{")) else None  # the whole answer is the calls

    def held_back(self, text: str) -> int:
        head = text.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return len(text)  # the answer may still open with a call
        return 0

    def parse(self, text: str, tools: Tools | None = None) -> ParsedAnswer:
        start = self.calls_start(text)
        if start is None:
            return ParsedAnswer(text)
        region = self.region(text[start:])
        pieces, rest = scan_objects(region, SEPARATORS)
        if rest or not pieces or not all(piece.closed for piece in pieces):
            return ParsedAnswer("", [ParsedCall(region.strip(), error="not a run of JSON calls separated by ';'")])
        return ParsedAnswer("", [parse_object(piece.text) for piece in pieces])

    def partial(self, region: str, tools: Tools | None = None) -> list[PartialCall]:
        region = self.region(region)
        if region == PYTHON_TAG[:len(region)]:
            return []
        return partial_objects(scan_objects(region, SEPARATORS)[0])

    @staticmethod
    def region(text: str) -> str:
        text = text.lstrip()
        return text.removeprefix(PYTHON_TAG)

    def forced_format(self, tools: Tools, single: bool) -> Any:
        from xgrammar.structural_tag import (
            GrammarFormat,
            TagFormat,
            TagsWithSeparatorFormat,
        )

        tags = [TagFormat(begin=f'{{"name": {json.dumps(tool["function"]["name"])}, "parameters": ',
                          content=GrammarFormat(grammar=arguments_grammar(tool["function"])), end="}")
                for tool in tools]
        return TagsWithSeparatorFormat(tags=tags, separator="; ", at_least_one=True, stop_after_first=single)
