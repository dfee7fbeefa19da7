"""gpt-oss's harmony calls: a message addressed to a function, its arguments the message's JSON body.

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The recipient may also stand before the channel (`<|start|>assistant to=functions.get_weather<|channel|>
commentary json<|message|>...`), the channel may be `analysis`, and `<|call|>` (a stop token, which the
engine may drop) ends the call. Any message with a recipient is a call; one whose recipient is not a
`functions.` name (a built-in tool such as `browser.search`) or whose body is not a JSON object is a
malformed call, so the answer stays text. The messages are read by messages.py; with the
harmony reasoning parser in front, only the calls still carry their markup when they get here.
"""

from __future__ import annotations

import json
from typing import Any

from .messages import CHANNEL, COMMENTARY, CONSTRAIN, FUNCTIONS, MARKERS, MESSAGE, Message, read_messages
from ..tool_calls.base import ParsedAnswer, ParsedCall, PartialCall, ToolParser, Tools
from ..tool_calls.grammar import arguments_grammar


class HarmonyParser(ToolParser):
    name = "harmony"
    markers = MARKERS

    def calls_start(self, text: str) -> int | None:
        messages, _ = read_messages(text, complete=False)
        return next((m.start for m in messages if m.header.is_call), None)

    def held_back(self, text: str) -> int:
        _, settled = read_messages(text, complete=False)
        return len(text) - settled  # a header not yet read to its end may still address a function

    def parse(self, text: str, tools: Tools | None = None) -> ParsedAnswer:
        messages, _ = read_messages(text)
        calls = [m for m in messages if m.header.is_call]
        if not calls:
            return ParsedAnswer(text)
        content, at = "", 0
        for call in calls:
            content, at = content + text[at:call.start], call.stop
        return ParsedAnswer((content + text[at:]).strip(), [parse_call(text, call) for call in calls])

    def partial(self, region: str, tools: Tools | None = None) -> list[PartialCall]:
        messages, _ = read_messages(region, complete=False)
        calls = []
        for message in messages:
            name = function_name(message)
            if name is None:
                break
            calls.append(PartialCall(name, message.body.lstrip(), message.closed))
            if not message.closed:
                break
        return calls

    def forced_format(self, tools: Tools, single: bool) -> Any:
        """One call of one of `tools`, written as gpt-oss writes it: a turn ends at its call (`<|call|>`,
        a stop token, follows the arguments), so `single` changes nothing."""
        from xgrammar.structural_tag import ConstStringFormat, GrammarFormat, OrFormat, SequenceFormat

        calls = [SequenceFormat(elements=[ConstStringFormat(value=call_header(tool["function"]["name"])),
                                          GrammarFormat(grammar=arguments_grammar(tool["function"]))])
                 for tool in tools]
        return calls[0] if len(calls) == 1 else OrFormat(elements=calls)


def call_header(name: str) -> str:
    return f"{CHANNEL}{COMMENTARY} to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def function_name(message: Message) -> str | None:
    """The function a message calls, or None when it calls none (no recipient, or not a function)."""
    recipient = message.header.recipient
    if recipient is None or not recipient.startswith(FUNCTIONS) or recipient == FUNCTIONS:
        return None
    return recipient[len(FUNCTIONS):]


def parse_call(text: str, message: Message) -> ParsedCall:
    body = text[message.start:message.stop].strip()
    name = function_name(message)
    if name is None:
        return ParsedCall(body, error=f"recipient {message.header.recipient!r} is not a function ({FUNCTIONS}NAME)")
    try:
        arguments = json.loads(message.body) if message.body.strip() else {}
    except json.JSONDecodeError as exc:
        return ParsedCall(body, error=f"JSONDecodeError: {exc}")
    if not isinstance(arguments, dict):
        return ParsedCall(body, error="a call's arguments must be a JSON object")
    return ParsedCall(body, name, arguments)
