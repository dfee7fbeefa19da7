"""What the front ends share about structured outputs: a forced tool call as a grammar, the
response formats as specs, and the instruction that tells the model a JSON answer is wanted.

The engine holds every answer to its spec token by token (`paged_backend.sampling.grammar`); this module
only translates OpenAI's and LangChain's vocabulary into `StructuredOutputsParams`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from paged_backend.sampling.structured_outputs import StructuredOutputsParams

from paged_backend.entrypoints.tool_calls import get_tool_parser

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


def forced_tool_spec(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True,
                     parser: Any = None) -> StructuredOutputsParams | None:
    """A grammar for the calls `tool_choice` forces, in the format of `parser` (a `ToolParser`; Hermes,
    the form the tool policy teaches, by default): with required/any, one or more calls of any bound
    tool (one when `parallel` is off); with a named tool, one call of it. None when the model may
    answer freely."""
    name = chosen_tool_name(tools, tool_choice)
    if name is None:
        return None
    chosen = [t for t in tools if name in ("", t["function"]["name"])]
    # Key order kept: the grammar writes an object's properties in the order its schema lists them.
    return StructuredOutputsParams(grammar=tool_call_grammar(json.dumps(chosen), single=bool(name) or not parallel,
                                                             parser_name=getattr(parser, "name", "hermes")))


class ToolSchemaError(ValueError):
    """A tool whose parameters are not a JSON schema: its place in the tools list, its name, why."""

    def __init__(self, index: int, name: Any, reason: str) -> None:
        super().__init__(f"tools[{index}] ({name!r}): its parameters are not a valid JSON schema: {reason}")
        self.index, self.name, self.reason = index, name, reason


def check_tool_schemas(tools: list[dict[str, Any]] | None) -> None:
    """ToolSchemaError for the first tool whose parameters are not a JSON schema the grammar engine
    reads. Checked whether a call is forced or not: a call the model writes is parsed against its tool's
    schema, and a schema broken from the start is the caller's error, not the server's."""
    for index, tool in enumerate(tools or []):
        function = tool.get("function", {})
        parameters = function.get("parameters")
        if parameters is None:
            continue
        try:
            StructuredOutputsParams(json=parameters)
        except ValueError as exc:
            reason = str(exc).removeprefix("structured_outputs.json is invalid: ")
            raise ToolSchemaError(index, function.get("name"), reason) from None


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
def tool_call_grammar(tools_json: str, single: bool = False, parser_name: str = "hermes") -> str:
    """EBNF of the calls of these tools in the named format (for Hermes: `<tool_call>\\n{"name": ...,
    "arguments": {...}}\\n</tool_call>` blocks, one per line): at least one, and exactly one when `single`."""
    import xgrammar
    from xgrammar.structural_tag import StructuralTag

    calls = get_tool_parser(parser_name).forced_format(json.loads(tools_json), single)
    return str(xgrammar.Grammar.from_structural_tag(StructuralTag(format=calls)))


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
