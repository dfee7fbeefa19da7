"""Mistral calls after `[TOOL_CALLS]`, in either of Mistral's two forms: a JSON array
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo, Small 3.1) or one
`[TOOL_CALLS]name[ARGS]{...}` per call (the tokenizer v11+ form: Mistral Small 3.2, Magistral,
Devstral). The text before the first `[TOOL_CALLS]` is content."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .base import (
    ParsedAnswer,
    ParsedCall,
    PartialCall,
    ToolParser,
    Tools,
    suffix_prefix,
)
from .grammar import arguments_grammar
from .json_calls import parse_object, partial_objects, scan_objects

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS)
    forced_prefix = TOOL_CALLS  # a control token: a grammar writes the array after it

    def calls_start(self, text: str) -> int | None:
        at = text.find(TOOL_CALLS)
        return None if at < 0 else at

    def held_back(self, text: str) -> int:
        return suffix_prefix(text, TOOL_CALLS)

    def parse(self, text: str, tools: Tools | None = None) -> ParsedAnswer:
        start = self.calls_start(text)
        if start is None:
            return ParsedAnswer(text)
        calls: list[ParsedCall] = []
        for segment in text[start:].split(TOOL_CALLS)[1:]:
            calls.extend(parse_segment(segment.strip()))
        return ParsedAnswer(text[:start].strip(), calls)

    def partial(self, region: str, tools: Tools | None = None) -> list[PartialCall]:
        calls: list[PartialCall] = []
        segments = region.split(TOOL_CALLS)[1:]
        for k, segment in enumerate(segments):
            closed = k < len(segments) - 1
            segment = segment.lstrip()
            if segment.startswith("["):
                found = partial_objects(scan_objects(segment[1:], ",]")[0])
            elif ARGS in segment:
                name, arguments = segment.split(ARGS, 1)
                found = [PartialCall(name.strip(), *arguments_so_far(arguments, closed))]
            else:
                break
            calls.extend(found)
            if not found or not found[-1].closed:
                break
        return calls

    def forced_format(self, tools: Tools, single: bool) -> Any:
        from xgrammar.structural_tag import (
            ConstStringFormat,
            GrammarFormat,
            SequenceFormat,
            TagFormat,
            TagsWithSeparatorFormat,
        )

        tags = [TagFormat(begin=f'{{"name": {json.dumps(tool["function"]["name"])}, "arguments": ',
                          content=GrammarFormat(grammar=arguments_grammar(tool["function"])), end="}")
                for tool in tools]
        calls = TagsWithSeparatorFormat(tags=tags, separator=", ", at_least_one=True, stop_after_first=single)
        return SequenceFormat(elements=[ConstStringFormat(value="["), calls, ConstStringFormat(value="]")])


def arguments_so_far(text: str, closed: bool) -> tuple[str, bool]:
    """The `[ARGS]` object written so far, and whether it is complete: it ends with its last brace, and
    an open one is held back where it may be the next `[TOOL_CALLS]` beginning."""
    pieces, _ = scan_objects(text, "")
    if pieces and pieces[0].closed:
        return pieces[0].text, True
    text = text.lstrip()
    return text[:len(text) - suffix_prefix(text, TOOL_CALLS)], closed


def parse_segment(segment: str) -> list[ParsedCall]:
    """The calls after one `[TOOL_CALLS]`: a JSON array of calls, or `name[ARGS]{...}`."""
    if segment.startswith("["):
        try:
            items = json.loads(segment)
        except json.JSONDecodeError as exc:
            return [ParsedCall(segment, error=f"JSONDecodeError: {exc}")]
        if not isinstance(items, list) or not items:
            return [ParsedCall(segment, error="[TOOL_CALLS] must be followed by a non-empty array of calls")]
        return [parse_object(json.dumps(item, ensure_ascii=False)) for item in items]
    name, sep, arguments = segment.partition(ARGS)
    if not sep or not name.strip():
        return [ParsedCall(segment, error="expected [TOOL_CALLS]name[ARGS]{arguments}")]
    call = parse_object(json.dumps({"name": name.strip(), "arguments": arguments.strip()}))
    return [dataclasses.replace(call, body=segment)]
