"""Tool-call formats, one parser per model family, behind one interface (`base.ToolParser`).

The seam (see ARCHITECTURE.md): `resolve_tool_parser(name, tokenizer)` gives a parser ("auto": the
one the chat template's markers name, Hermes when they name none); `parser.parse(text, tools)` splits
a finished answer into content and calls; `ToolCallStream(parser, tools)` streams one (content as it
is certain, call pieces as they are written); `forced_tool_spec` (entrypoints/structured.py) holds a
forced call to the format's grammar.
"""

from __future__ import annotations

from typing import Any

from .base import (
    CallDeltas,
    ParsedAnswer,
    ParsedCall,
    PartialCall,
    ToolCallStream,
    ToolParser,
    content_so_far,
    keeps_special_tokens,
)
from ..harmony.tool_calls import HarmonyParser
from .hermes import HermesParser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in
                                  (HermesParser(), Llama3JsonParser(), MistralParser(), Qwen3CoderParser(),
                                                HarmonyParser())}
AUTO = "auto"
HERMES = PARSERS["hermes"]

__all__ = ["AUTO", "HERMES", "PARSERS", "CallDeltas", "ParsedAnswer", "ParsedCall", "PartialCall", "ToolCallStream",
           "ToolParser", "content_so_far", "detect_tool_parser", "get_tool_parser", "keeps_special_tokens",
           "resolve_tool_parser", "tool_parser_names"]


def tool_parser_names() -> list[str]:
    return sorted(PARSERS)


def get_tool_parser(name: str, field: str = "tool_call_parser") -> ToolParser:
    """The parser registered as `name`; a ValueError naming `field` and the known names otherwise."""
    try:
        return PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{field}={name!r} is not a tool-call parser; known: {tool_parser_names()} "
                         f"(or {AUTO!r})") from None


def detect_tool_parser(chat_template: Any) -> ToolParser | None:
    """The format a chat template teaches, when its markers name exactly one; else None."""
    if not isinstance(chat_template, str):
        return None
    found = []
    if "<tool_call>" in chat_template:
        found.append("qwen3_coder" if "<function=" in chat_template else "hermes")
    if "[TOOL_CALLS]" in chat_template:
        found.append("mistral")
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        found.append("llama3_json")
    if "<|channel|>" in chat_template and "<|message|>" in chat_template:
        found.append("harmony")  # gpt-oss: calls are messages to functions.NAME
    return PARSERS[found[0]] if len(found) == 1 else None


def resolve_tool_parser(name: str | None, tokenizer: Any, field: str = "tool_call_parser") -> ToolParser:
    """`name` as a front end's option: None or "auto" for the template's format (Hermes, which the tool
    policy teaches templates that render no tools, when the template names none), else a registered name."""
    if name is None or name == AUTO:
        return detect_tool_parser(getattr(tokenizer, "chat_template", None)) or HERMES
    return get_tool_parser(name, field)
