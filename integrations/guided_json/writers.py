"""Guided-JSON writers: the structure of a schema's (or a forced tool call's, or any object's) JSON,
written for the model, with an `Ask` for each value it must fill in. Pure text: no tokenizer, no engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from ..hermes import CLOSE, OPEN

NUMBER_STOPS = [",", "}", "]", "\n"]
STRING_STOPS = ['"']
MAX_FREE_DEPTH = 4  # how deep a schema-free (json_object) answer may nest objects and arrays
MAX_SCHEMA_DEPTH = 32  # deeper is a recursive schema, which guided writing cannot bound
JSON_INSTRUCTION = "Answer with one JSON object only, and nothing else."

# JSON numbers, whole and as prefixes that can still become one ("1.e5" cannot; "1.", "-" and "1e" can).
NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9]\d*)(?:\.\d*|(?:\.\d+)?[eE][+-]?\d*)?)?")
INTEGER = re.compile(r"-?(?:0|[1-9]\d*)")
INTEGER_PREFIX = re.compile(r"-?(?:0|[1-9]\d*)?")


class UnsupportedSchema(ValueError):
    """A JSON-schema feature guided writing cannot hold the model to."""


@dataclass(frozen=True, slots=True)
class NumberRule:
    integer: bool
    prefix: str = ""  # already written before this request (a free value's first character)


@dataclass(frozen=True, slots=True)
class ChoiceRule:
    options: tuple[str, ...]


Rule = NumberRule | ChoiceRule


class Ask(NamedTuple):
    text: str  # the assistant text so far: the model continues from here
    stops: list[str]  # strings that end the value (cut off, not part of it)
    rule: Rule | None = None  # what the value's tokens must follow; None: a free string up to its quote


Writer = Generator[Ask, str, str]


# ------------------------------------------------------------------ writers


def write_value(text: str, schema: dict[str, Any], root: dict[str, Any] | None = None, depth: int = 0) -> Writer:
    """Append a JSON value following `schema` to `text`, asking the model for each leaf value."""
    if depth > MAX_SCHEMA_DEPTH:
        raise UnsupportedSchema(f"a schema nested deeper than {MAX_SCHEMA_DEPTH} levels (a recursive schema?)")
    root = schema if root is None else root
    schema = resolve(schema, root)
    if "const" in schema:
        return text + json.dumps(schema["const"], ensure_ascii=False)
    if "enum" in schema:
        return (yield from write_choice(text, [json.dumps(v, ensure_ascii=False) for v in schema["enum"]]))
    kind = schema_type(schema)
    if kind == "object":
        return (yield from write_object(text, schema, root, depth))
    if kind == "array":
        return (yield from write_array(text, schema, root, depth))
    if kind == "string":
        return text + json.dumps((yield Ask(text + '"', STRING_STOPS)), ensure_ascii=False)
    if kind in ("integer", "number"):
        raw = yield Ask(text, NUMBER_STOPS, NumberRule(integer=kind == "integer"))
        return text + repair_number(raw, kind == "integer")
    if kind == "boolean":
        return (yield from write_choice(text, ["true", "false"]))
    if kind == "null":
        return text + "null"
    raise UnsupportedSchema(f"a value of type {kind!r}")


def write_object(text: str, schema: dict[str, Any], root: dict[str, Any], depth: int) -> Writer:
    properties = schema.get("properties") or {}
    if not properties and isinstance(schema.get("additionalProperties"), dict):
        raise UnsupportedSchema("an object with additionalProperties (a free-form mapping)")
    text += "{"
    for i, (key, prop) in enumerate(properties.items()):
        head = text + (", " if i else "") + json.dumps(key, ensure_ascii=False) + ": "
        text = yield from write_value(head, prop, root, depth + 1)
    return text + "}"


def write_array(text: str, schema: dict[str, Any], root: dict[str, Any], depth: int) -> Writer:
    """Items until the model picks "]" over ",": at least one (and minItems), at most maxItems."""
    items = schema.get("items")
    if not isinstance(items, dict):
        raise UnsupportedSchema("an array without one 'items' schema (tuple or free-form arrays)")
    low, high = max(1, schema.get("minItems", 0)), schema.get("maxItems")
    if high == 0:
        return text + "[]"
    text += "["
    count = 0
    while True:
        text = yield from write_value(text, items, root, depth + 1)
        count += 1
        if count < low:
            text += ", "
            continue
        if high is not None and count >= high:
            return text + "]"
        text = yield from write_choice(text, [",", "]"])
        if text.endswith("]"):
            return text
        text += " "


def write_free_object(text: str, depth: int = 0) -> Writer:
    """Any JSON object (response_format json_object): the model picks the keys, each value's type and
    when to stop; nesting stops at MAX_FREE_DEPTH. Every closing option comes last, so a spent
    max_tokens (whose default answer is the last option) closes what is open."""
    text += "{"
    chosen = yield from write_choice(text, ['"', "}"])
    while chosen.endswith('"'):
        key = yield Ask(chosen, STRING_STOPS)
        # No space after the colon: the value's first token brings its own, as BPE vocabularies spell it.
        text = chosen + json.dumps(key, ensure_ascii=False)[1:] + ":"
        text = yield from write_free_value(text, depth + 1, lead=" ")
        chosen = yield from write_choice(text, [",", "}"])
        if chosen.endswith(","):
            chosen += ' "'
    return chosen


def write_free_array(text: str, depth: int) -> Writer:
    text += "["
    chosen = yield from write_choice(text, [*value_starts(depth), "]"])
    while not chosen.endswith("]"):
        text = yield from write_started_value(text, chosen[len(text):], depth + 1)
        chosen = yield from write_choice(text, [",", "]"])
        if chosen.endswith(","):
            text = chosen
            chosen = yield from write_choice(text, value_starts(depth, lead=" "))
    return chosen


def write_free_value(text: str, depth: int, lead: str = "") -> Writer:
    chosen = yield from write_choice(text, value_starts(depth, lead))
    return (yield from write_started_value(text, chosen[len(text):], depth))


def write_started_value(text: str, start: str, depth: int) -> Writer:
    """The rest of a free value whose first token the model chose (`start`, one of value_starts)."""
    text, start = text + start[: len(start) - len(start.lstrip())], start.lstrip()
    if start == '"':
        return text + json.dumps((yield Ask(text + '"', STRING_STOPS)), ensure_ascii=False)
    if start == "{":
        return (yield from write_free_object(text, depth))
    if start == "[":
        return (yield from write_free_array(text, depth))
    if start in ("true", "false", "null"):
        return text + start
    raw = yield Ask(text + start, NUMBER_STOPS, NumberRule(integer=False, prefix=start))
    return text + repair_number(start + raw, integer=False)


def value_starts(depth: int, lead: str = "") -> list[str]:
    """How a free value may begin (after `lead`); "null" last, so a spent max_tokens ends it at once."""
    nested = ["{", "["] if depth < MAX_FREE_DEPTH else []
    return [lead + s for s in ['"', *nested, "-", *"0123456789", "true", "false", "null"]]


def write_choice(text: str, options: Sequence[str]) -> Writer:
    if len(options) == 1:
        return text + options[0]
    raw = yield Ask(text, [], ChoiceRule(tuple(options)))
    return text + resolve_choice(raw, options)


def write_tool_call(tools: list[dict[str, Any]], name: str) -> Writer:
    """A Hermes tool call of the named tool (or, for "", of the bound tool the model picks)."""
    names = [t["function"]["name"] for t in tools]
    head = OPEN + '\n{"name": '
    if name == "":
        text = yield from write_choice(head, [json.dumps(n, ensure_ascii=False) for n in names])
        name = json.loads(text[len(head):])
    else:
        text = head + json.dumps(name, ensure_ascii=False)
    schema = next(t for t in tools if t["function"]["name"] == name)["function"].get("parameters") or {}
    text = yield from write_value(text + ', "arguments": ', {"type": "object", **schema})
    return text + "}\n" + CLOSE


def add_json_instruction(messages: list[dict[str, Any]], schema: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Ask for JSON (following `schema`, if given) in the system turn, after the caller's own system text.
    The writers hold the model to the shape; seeing the schema helps it choose sensible values."""
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


def chosen_tool_name(tools: list[dict[str, Any]], tool_choice: Any) -> str | None:
    """None: the model decides; "": some tool must be called; else the tool that must be called."""
    if not tools or tool_choice in (None, "auto", "none", False):
        return None
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
    if tool_choice in ("any", "required", True):
        return tools[0]["function"]["name"] if len(tools) == 1 else ""
    names = [t["function"]["name"] for t in tools]
    if tool_choice not in names:
        raise ValueError(f"tool_choice={tool_choice!r} names no bound tool; bound: {names}")
    return tool_choice


def choose_writer(tools: list[dict[str, Any]], tool_choice: Any,
                  response_format: dict[str, Any] | None) -> Callable[[], Writer] | None:
    """The writer for a forced tool call (OpenAI `tools`/`tool_choice`), or for an answer that must follow
    a `json_schema` response format; None when the model writes freely. A schema the writers cannot
    follow raises UnsupportedSchema here, before any request runs."""
    name = chosen_tool_name(tools, tool_choice)
    if name is not None:
        for candidate in [name] if name else [t["function"]["name"] for t in tools]:
            check_writer(write_tool_call(tools, candidate))
        return partial(write_tool_call, tools, name)
    if response_format is not None and response_format.get("type") == "json_schema":
        schema = response_format["json_schema"]["schema"]
        check_writer(write_value("", schema))
        return partial(write_value, "", schema)
    if response_format is not None and response_format.get("type") == "json_object":
        return partial(write_free_object, "")
    return None


def check_writer(writer: Writer) -> None:
    """Raise UnsupportedSchema now, before any request runs, for what the writer could not follow."""
    try:
        ask = next(writer)
        while True:  # feed each ask a canned valid answer to walk the whole schema
            ask = writer.send(default_answer(ask))
    except StopIteration:
        return


def default_answer(ask: Ask) -> str:
    """A valid value written without the model: once the call's max_tokens is spent, or to walk a schema."""
    if isinstance(ask.rule, NumberRule):
        return "0"
    if isinstance(ask.rule, ChoiceRule):
        return ask.rule.options[-1]  # "]" for arrays, so the walk ends
    return ""


# ------------------------------------------------------------------ schema helpers


def resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """Follow local $refs and the one-branch wrappers pydantic writes (allOf [ref], anyOf [T, null])."""
    for _ in range(32):
        if "$ref" in schema:
            schema = {**lookup(schema["$ref"], root), **{k: v for k, v in schema.items() if k != "$ref"}}
        elif "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise UnsupportedSchema("allOf with several schemas")
            schema = {**{k: v for k, v in schema.items() if k != "allOf"}, **schema["allOf"][0]}
        elif "anyOf" in schema or "oneOf" in schema:
            key = "anyOf" if "anyOf" in schema else "oneOf"
            branches = [b for b in schema[key] if b.get("type") != "null"]
            if len(branches) != 1:
                raise UnsupportedSchema(f"{key} with several non-null choices")
            schema = {**{k: v for k, v in schema.items() if k != key}, **branches[0]}
        else:
            return schema
    raise UnsupportedSchema("a $ref chain deeper than 32 (a recursive schema)")


def lookup(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise UnsupportedSchema(f"the non-local $ref {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            raise UnsupportedSchema(f"the $ref {ref!r}, which names nothing in the schema")
        node = node[part]
    return node


def schema_type(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        if len(kinds) != 1:
            raise UnsupportedSchema(f"type {kind!r} (several non-null types)")
        return kinds[0]
    if kind is None:
        if "properties" in schema:
            return "object"
        raise UnsupportedSchema("a schema without a type")
    return kind


# ------------------------------------------------------------------ what the model wrote, made valid


def repair_number(raw: str, integer: bool) -> str:
    """The longest valid number the model's text starts with. The logits rule lets only valid prefixes
    through, so this only trims a number that max_tokens cut short (e.g. "1." -> "1")."""
    found = (INTEGER if integer else NUMBER).match(raw.strip())
    return found.group(0) if found else "0"


def resolve_choice(raw: str, options: Sequence[str]) -> str:
    """The option the model wrote, or the first it had started (if max_tokens cut it short)."""
    if raw in options:
        return raw
    return next((o for o in options if o.startswith(raw)), options[0])
