"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block
per call, possibly between text (the tags live in tool_call_tags.py)."""

from __future__ import annotations

import json
from typing import Any

from .base import ParsedCall, PartialCall, Tools
from .tool_call_tags import BLOCK, CLOSE, OPEN, TaggedCallParser
from .grammar import arguments_grammar
from .json_calls import Piece, parse_object, partial_object


class HermesParser(TaggedCallParser):
    name = "hermes"

    def read_block(self, body: str, tools: Tools | None) -> ParsedCall:
        return parse_object(body)

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

