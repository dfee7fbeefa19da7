"""Tool calls: rendering tools for the chat template, choosing the forced tool, parsing calls back.

Calls are parsed in the model's format (`paged_backend/entrypoints/tool_calls/`: Hermes/Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` unless the template or `tool_call_parser`
names another). A tokenizer that ships a `response_template` is parsed with transformers' own parser
instead, unless a format is named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from paged_backend.entrypoints.tool_calls.base import new_call_id
from paged_backend.entrypoints.tool_calls import (
    HERMES,
    ParsedCall,
    ToolCallStream,
    ToolParser,
    content_so_far,
)
from paged_backend.entrypoints.tool_calls.json_calls import parse_object

# ChatML with tools rendered Hermes/Qwen style, for models whose own template ignores tools.
# Without tools it renders what SmolLM2's template renders.
HERMES_TOOL_TEMPLATE = r"""
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}
{%- else %}
    {%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}{%- set rest = messages %}
{%- endif %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' }}
    {{- '<args-json-object>}\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in rest %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message['content'] or '') }}
        {%- for call in message['tool_calls'] or [] %}
            {%- set fn = call['function'] %}
            {%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' }}
            {{- (fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@dataclass(slots=True)
class ParsedResponse:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # LangChain ToolCall dicts
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None  # the thinking of a reasoning model, split off before the calls


def parse_calls(text: str, parser: ToolParser = HERMES, tools: list[dict[str, Any]] | None = None,
                prefix: str = "") -> ParsedResponse:
    """Split the calls out of the text in `parser`'s format; an unfinished last call counts (max_tokens
    cut it) and a call that does not parse is an invalid one. `prefix`: what a forced call's grammar
    left out of the text."""
    parsed = parser.parse(prefix + text, tools)
    result = ParsedResponse(content=parsed.content if parsed.calls else text)
    for call in parsed.calls:
        add_call(result, call)
    return result


def parse_hermes(text: str) -> ParsedResponse:
    """Split `<tool_call>` blocks out of the text; an unclosed last block counts (max_tokens cut it)."""
    return parse_calls(text)


def parse_with_tokenizer(tokenizer: Any, text: str, prompt_text: str, tools: list[dict[str, Any]]) -> ParsedResponse:
    """Use the tokenizer's response_template parser (transformers' chat_parsing)."""
    message = tokenizer.parse_response(text, prefix=prompt_text, tools=tools)
    result = ParsedResponse(content=(message.get("content") or "").strip())
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        add_call(result, parse_object(json.dumps({"name": function.get("name"),
                                                  "arguments": function.get("arguments", {})})))
    return result


def add_call(result: ParsedResponse, call: ParsedCall) -> None:
    """A valid call as a LangChain ToolCall; anything else as an InvalidToolCall keeping the raw text."""
    call_id = new_call_id()
    if call.valid:
        result.tool_calls.append({"type": "tool_call", "name": call.name, "args": call.arguments, "id": call_id})
    else:
        result.invalid_tool_calls.append({"type": "invalid_tool_call", "name": None, "args": call.body,
                                          "id": call_id, "error": call.error})


class ContentStreamer:
    """Releases streamed text that is certainly content: never a tool call, nor the start of one, nor
    whitespace that parsing would strip. With `calls`, each call's name and arguments stream too, as
    LangChain tool-call chunks; the rest comes from the final parse. With `hold` everything waits for
    the final parse (transformers' parser reads the whole text)."""

    def __init__(self, parser: ToolParser = HERMES, calls: ToolCallStream | None = None, hold: bool = False,
                 prefix: str = "") -> None:
        self.parser = parser
        self.text = prefix  # a forced call's prefix (`ToolParser.forced_prefix`) is never content
        self.released = ""
        self.calls = calls
        self.hold = hold

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.calls is not None:
            self.calls.text += delta
        if self.hold:
            return ""
        visible = content_so_far(self.parser, self.text).strip()  # grows monotonically until a call begins
        new = visible[len(self.released):]
        self.released = visible
        return new

    def call_chunks(self) -> list[dict[str, Any]]:
        """Tool-call chunks for what the calls' text so far adds."""
        if self.calls is None:
            return []
        return [{"type": "tool_call_chunk", "name": d.name, "args": d.arguments, "index": d.index,
                 "id": new_call_id() if d.name is not None else None} for d in self.calls.deltas()]

    def final_call_chunks(self, parsed: ParsedResponse) -> list[dict[str, Any]]:
        """The calls' last pieces: the rest of those that streamed, and whole the calls after them."""
        chunks = self.call_chunks()
        streamed = self.calls.calls.streamed if self.calls is not None else 0
        for index, call in enumerate((parsed.tool_calls + parsed.invalid_tool_calls)[streamed:], start=streamed):
            chunks.append(tool_call_chunk(call, index))
        return chunks

    def finish(self, content: str) -> str:
        """The part of the final content not released yet."""
        return content[len(self.released):] if content.startswith(self.released) else ""


def tool_call_chunk(call: dict[str, Any], index: int) -> dict[str, Any]:
    args = call["args"] if isinstance(call["args"], str) else json.dumps(call["args"], ensure_ascii=False)
    return {"type": "tool_call_chunk", "name": call["name"], "args": args, "id": call["id"], "index": index}
