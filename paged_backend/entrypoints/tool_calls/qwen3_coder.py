"""Qwen3-Coder XML calls (Qwen3-Coder, Qwen3-Next and Qwen3.5 templates):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text; it becomes JSON by the tool's schema (integers, numbers, booleans,
objects and arrays parsed, strings kept). Streamed, each parameter is sent once its closing tag is
written, as `{"name": value` and `, "name": value`, and the closing brace with `</function>`: the
pieces add up to the same JSON text as the finished call's arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ParsedCall, PartialCall, Tools
from .tool_call_tags import BLOCK, CLOSE, OPEN, TaggedCallParser

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(</function>|\Z)", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)


class Qwen3CoderParser(TaggedCallParser):
    name = "qwen3_coder"

    def read_block(self, body: str, tools: Tools | None) -> ParsedCall:
        return parse_block(body, tools)

    def partial(self, region: str, tools: Tools | None = None) -> list[PartialCall]:
        calls = []
        for block in BLOCK.finditer(region):
            function = FUNCTION.match(block.group(1))
            if function is None:  # its name is not written yet
                break
            name, closed = function.group(1).strip(), bool(function.group(3))
            pairs = [(key, value) for key, value, end in parameters(function.group(2), closed) if end]
            calls.append(PartialCall(name, arguments_text(name, pairs, tools, closed), closed))
            if not closed:
                break
        return calls

    def forced_format(self, tools: Tools, single: bool) -> Any:
        from xgrammar.structural_tag import (
            JSONSchemaFormat,
            TagFormat,
            TagsWithSeparatorFormat,
        )

        tags = [TagFormat(begin=f"{OPEN}\n<function={tool['function']['name']}>\n",
                          content=JSONSchemaFormat(json_schema=schema_of(tool), style="qwen_xml"),
                          end=f"\n</function>\n{CLOSE}")
                for tool in tools]
        return TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=single)


def parameters(body: str, closed: bool) -> list[tuple[str, str, bool]]:
    """(name, raw value, complete) per parameter; in an open call the last one may still grow."""
    found = []
    for match in PARAMETER.finditer(body):
        complete = bool(match.group(3)) or match.end() < len(body) or closed  # a closing tag, or a tag after it
        found.append((match.group(1).strip(), match.group(2), complete))
    return found


def parse_block(body: str, tools: Tools | None) -> ParsedCall:
    function = FUNCTION.match(body)
    if function is None:
        return ParsedCall(body.strip(), error="a call must be <function=NAME> with <parameter=NAME> values")
    name = function.group(1).strip()
    return ParsedCall(body.strip(), name, {key: typed(name, key, value, tools)
                                           for key, value, _ in parameters(function.group(2), True)})


def arguments_text(name: str, pairs: list[tuple[str, str]], tools: Tools | None, closed: bool) -> str:
    """The JSON text of the complete parameters so far; `json.dumps` of the finished arguments equals it."""
    text = "{" + ", ".join(f"{json.dumps(key, ensure_ascii=False)}: "
                           f"{json.dumps(typed(name, key, value, tools), ensure_ascii=False)}" for key, value in pairs)
    return text + "}" if closed else text


def typed(function: str, key: str, raw: str, tools: Tools | None) -> Any:
    """A raw value as its schema says: strings keep their text (less the newline each side the template
    writes), anything else is read as JSON around its whitespace (a value that does not parse stays text)."""
    value = raw.removeprefix("\n").removesuffix("\n")
    kind, enum = property_type(function, key, tools)
    if kind == "string" and not enum:
        return value
    value = value.strip()
    if kind == "string":
        return value
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = json.loads(value)
            return number if isinstance(number, (int, float)) else value
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return json.loads(value)
    except ValueError:
        return value


def property_type(function: str, key: str, tools: Tools | None) -> tuple[str | None, bool]:
    """(the property's schema type, whether it lists an enum); ("string", False) with no schema to go by."""
    for tool in tools or []:
        spec = tool.get("function", {})
        if spec.get("name") == function:
            prop = ((spec.get("parameters") or {}).get("properties") or {}).get(key) or {}
            kind = prop.get("type")
            return (kind if isinstance(kind, str) else None), "enum" in prop
    return "string", False


def schema_of(tool: dict[str, Any]) -> dict[str, Any]:
    parameters_schema = tool["function"].get("parameters") or {}
    return {"type": "object", **parameters_schema}

