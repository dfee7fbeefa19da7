"""Guided writing: the adapter writes the JSON structure of a forced tool call (or a schema-shaped
answer) and asks the model only for the values, one engine request each.

A writer is a generator: it yields (the assistant text so far, stop strings), is sent back what
the model wrote after that text, and finally returns the whole text. `drive`/`adrive` run it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Generator
from functools import partial
from typing import Any

from .completion import Completion
from .tool_calls import CLOSE, OPEN, chosen_tool_name

# Stop strings that end a value the model writes inside a forced call, by JSON type.
VALUE_STOPS = {"string": ['"'], "integer": [",", "}", "\n"], "number": [",", "}", "\n"], "boolean": [",", "}", "\n"]}
# What guided_call yields: (the call text so far, stop strings); it is sent back the model's continuation.
Ask = tuple[str, list[str]]


def guided_call(tools: list[dict[str, Any]], name: str) -> Generator[Ask, str, str]:
    """Write a forced call's JSON and ask the model only for the values (the name too, if "").

    Small models asked to write the whole call drift into the schema's own keywords; writing
    the structure for them and stopping each value at its JSON delimiter keeps the call well
    formed."""
    text = OPEN + '\n{"name": "'
    if name == "":
        name = (yield text, ['"']).strip()
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        return text + name  # not a bound tool: parses as an invalid call
    schema = next(t for t in tools if t["function"]["name"] == name)["function"].get("parameters", {})
    text = yield from guided_object(text + name + '", "arguments": ', schema)
    return text + "}\n" + CLOSE


def guided_object(text: str, schema: dict[str, Any]) -> Generator[Ask, str, str]:
    """Append a JSON object following `schema` to `text`, asking the model for each value.

    A property that is not a plain string, number or boolean ends the guidance: the model
    writes the rest of the object itself."""
    text += "{"
    for i, (key, prop) in enumerate(schema.get("properties", {}).items()):
        head = text + (", " if i else "") + json.dumps(key, ensure_ascii=False) + ": "
        kind = value_type(prop)
        if kind not in VALUE_STOPS:
            return head + (yield head, [CLOSE])
        if kind == "string":
            text = head + json.dumps((yield head + '"', VALUE_STOPS[kind]), ensure_ascii=False)
        else:
            text = head + (yield head, VALUE_STOPS[kind]).strip()
    return text + "}"


def value_type(prop: dict[str, Any]) -> str | None:
    """The JSON type of a property; an optional one (anyOf [T, null]) counts as T."""
    if "type" in prop:
        return prop["type"] if isinstance(prop["type"], str) else None
    kinds = [p.get("type") for p in prop.get("anyOf", []) if p.get("type") != "null"]
    return kinds[0] if len(kinds) == 1 else None


def drive(writer: Generator[Ask, str, str], complete: Callable[[str, list[str]], Completion],
          prompt_tokens: int) -> Completion:
    """Run a guided writer: each value it asks for is one engine request (`complete`)."""
    done: Completion | None = None
    try:
        written, stops = next(writer)
        while True:
            step = complete(written, stops)
            done = step if done is None else done.then(step)
            written, stops = writer.send(step.text[len(written):])
    except StopIteration as end:
        return finish_guided(done, end.value, prompt_tokens)


async def adrive(writer: Generator[Ask, str, str], complete: Callable[[str, list[str]], Awaitable[Completion]],
                 prompt_tokens: int) -> Completion:
    done: Completion | None = None
    try:
        written, stops = next(writer)
        while True:
            step = await complete(written, stops)
            done = step if done is None else done.then(step)
            written, stops = writer.send(step.text[len(written):])
    except StopIteration as end:
        return finish_guided(done, end.value, prompt_tokens)


def finish_guided(done: Completion | None, text: str, prompt_tokens: int) -> Completion:
    if done is None:  # a tool without parameters: the call is complete without the model
        return Completion(text, text, "stop", {"input_tokens": prompt_tokens, "output_tokens": 0,
                                                "total_tokens": prompt_tokens, "input_token_details": {"cache_read": 0}},
                          [], None)
    return Completion(text, text, "stop", done.usage, done.token_ids, done.logprobs)


def choose_writer(tools: list[dict[str, Any]], tool_choice: Any,
                  response_format: dict[str, Any] | None) -> Callable[[], Generator[Ask, str, str]] | None:
    """Guided writing for a forced tool call, or for a JSON answer that must follow a schema."""
    name = chosen_tool_name(tools, tool_choice)
    if name is not None:
        return partial(guided_call, tools, name)
    if response_format is not None and response_format.get("type") == "json_schema":
        return partial(guided_object, "", response_format["json_schema"]["schema"])
    return None
