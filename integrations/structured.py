"""What the front ends share about structured outputs: a forced tool call as a grammar, the
response formats as specs, and the instruction that tells the model a JSON answer is wanted.

The engine holds every answer to its spec token by token (`paged_backend.sampling.grammar`); this module
only translates OpenAI's and LangChain's vocabulary into `StructuredOutputsParams`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from paged_backend.sampling.structured_outputs import StructuredOutputsParams, reason_of

from .hermes import CLOSE, OPEN

JSON_INSTRUCTION = "Answer with a single JSON object and nothing else."


def response_format_spec(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: json_schema (its `schema`) or json_object; None for text."""
    kind = (response_format or {}).get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), (dict, bool))):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return StructuredOutputsParams(json=spec["schema"])
    return None


def forced_tool_spec(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True) -> StructuredOutputsParams | None:
    """A grammar for the calls `tool_choice` forces, in the Hermes form the chat templates teach: with
    required/any, one or more calls of any bound tool (one when `parallel` is off); with a named tool,
    one call of it. None when the model may answer freely."""
    name = chosen_tool_name(tools, tool_choice)
    if name is None:
        return None
    chosen = [t for t in tools if name in ("", t["function"]["name"])]
    return StructuredOutputsParams(grammar=tool_call_grammar(json.dumps(chosen, sort_keys=True),
                                                             single=bool(name) or not parallel))


def chosen_tool_name(tools: list[dict[str, Any]], tool_choice: Any) -> str | None:
    """None: the model decides; "": some tool must be called; else the tool that must be called."""
    if not tools or tool_choice in (None, "auto", "none", False):
        return None
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
    if tool_choice in ("any", "required", True):
        return ""
    names = [t["function"]["name"] for t in tools]
    if tool_choice not in names:
        raise ValueError(f"tool_choice={tool_choice!r} names no bound tool; bound: {names}")
    return tool_choice


@functools.lru_cache(maxsize=128)
def tool_call_grammar(tools_json: str, single: bool = False) -> str:
    """EBNF of `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, one per line, for
    these tools: at least one, and exactly one when `single`."""
    import xgrammar
    from xgrammar.structural_tag import (
        GrammarFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    tags = [TagFormat(begin=f'{OPEN}\n{{"name": {json.dumps(tool["function"]["name"])}, "arguments": ',
                      content=GrammarFormat(grammar=arguments_grammar(tool["function"])), end=f"}}\n{CLOSE}")
            for tool in json.loads(tools_json)]
    calls = TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=single)
    return str(xgrammar.Grammar.from_structural_tag(StructuralTag(format=calls)))


def arguments_grammar(function: dict[str, Any]) -> str:
    """The EBNF of one tool's arguments object. Compact JSON: a small model given free whitespace may
    spend its tokens on it."""
    import xgrammar

    parameters = function.get("parameters") or {}
    schema = {"type": "object", **parameters} if isinstance(parameters, dict) else parameters
    try:
        return str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except RuntimeError as exc:
        raise ValueError(f"the parameters of tool {function['name']!r} are not a schema the grammar can follow: "
                         f"{reason_of(exc)}") from None


def add_json_instruction(messages: list[dict[str, Any]], schema: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Ask for JSON (following `schema`, if given) in the system turn, after the caller's own system text.
    The grammar holds the model to the shape; seeing the schema helps it choose sensible values."""
    instruction = JSON_INSTRUCTION
    if schema is not None:
        instruction += " It must follow this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)
    if not messages or messages[0].get("role") != "system":
        return [{"role": "system", "content": instruction}, *messages]
    content = messages[0].get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = [*content, {"type": "text", "text": "\n\n" + instruction}]
    else:
        content = (content or "") + "\n\n" + instruction
    return [{**messages[0], "content": content}, *messages[1:]]
