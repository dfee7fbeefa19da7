"""A forced tool call cut off by max_tokens reads alike streamed or whole, on every chat-shaped route: the
calls written whole are kept, the one cut short is kept as its stream sent it (marked incomplete), its
markup is never content, and the finish reason is the cut (`length`, `max_tokens`, an incomplete
response), never a finished call.

First the answer's reading cut at every character in each JSON-style format (no model), then the three
routes through the openai and anthropic SDKs, a tiny random model made to write two calls
(helpers/scripted.py) and cut at the places that matter.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import jiter
import pytest
from helpers.server import Served, serve_script
from paged_backend.entrypoints.answer_reader import AnswerReader
from paged_backend.integrations.server.messages import written_object
from paged_backend.entrypoints.tool_calls import PARSERS

pytestmark = pytest.mark.timeout(300)

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
ARGS = [{"city": "Paris", "days": 2}, {"city": "Rome", "days": 3}]

# Two calls as each format's forcing grammar writes them (less the forced prefix the grammar leaves out).
FORCED = {
    "hermes": "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(a)}}}\n</tool_call>'
                        for a in ARGS),
    "llama3_json": "; ".join(f'{{"name": "get_weather", "parameters": {json.dumps(a)}}}' for a in ARGS),
    "mistral": "[" + ", ".join(f'{{"name": "get_weather", "arguments": {json.dumps(a)}}}' for a in ARGS) + "]",
    "qwen3_coder": "\n".join(f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{a['city']}\n</parameter>\n"
                             f"<parameter=days>\n{a['days']}\n</parameter>\n</function>\n</tool_call>" for a in ARGS),
}


def streamed(plan: AnswerReader, text: str) -> tuple[str, list[tuple[str, str, bool]]]:
    """(content, [(name, arguments as streamed, complete)]) of `text` streamed a character at a time, cut."""
    reader = plan.stream()
    content, calls = "", {}
    pieces = [reader.push(char) for char in text] + [reader.finish(cut=True)]
    for piece in pieces:
        content += piece.content
        for delta in piece.calls:
            name, arguments = calls.get(delta.index, (delta.name, ""))
            calls[delta.index] = (name, arguments + delta.arguments)
    sent = [(name, arguments) for name, arguments in calls.values()]
    sent += [(call.name, call.arguments) for call in pieces[-1].unsent_calls]
    return content, [(*call, whole.complete) for call, whole in zip(sent, pieces[-1].tool_calls, strict=True)]


def arguments_of(arguments: str, complete: bool) -> object:
    """Complete calls compare as JSON (a plain answer re-serialises them); a cut one as the text sent."""
    return json.loads(arguments) if complete else arguments


@pytest.mark.parametrize("name", sorted(FORCED))
def test_a_forced_answer_cut_anywhere_reads_alike_streamed_or_whole(name: str) -> None:
    text = FORCED[name]
    for cut in range(len(text) + 1):
        plan = AnswerReader(tool_parser=PARSERS[name], tools=TOOLS, forced=True)
        _, content, calls = plan.split(text[:cut], cut=True)
        stream_content, stream_calls = streamed(AnswerReader(tool_parser=PARSERS[name], tools=TOOLS, forced=True),
                                                text[:cut])
        assert content is None and stream_content == "", (cut, content, stream_content)
        assert [(c.name, arguments_of(c.arguments, c.complete), c.complete) for c in calls] == \
            [(n, arguments_of(a, done), done) for n, a, done in stream_calls], cut
        assert [json.loads(c.arguments) for c in calls if c.complete] == ARGS[:sum(c.complete for c in calls)]
        assert all(c.complete for c in calls[:-1])
    assert [c.complete for c in plan.split(text, cut=True)[2]] == [True, True]


@pytest.mark.parametrize("text", ['', '{', '{"ci', '{"city"', '{"city": ', '{"city": "Ro', '{"city": "Rome"',
                                  '{"city": "Rome", ', '{"city": "Rome", "days": 3', '{"a": {"b": [1, "x\\"y',
                                  '{"a": {"b": [1, {"c": null}], "d": tr', '{"a": "}],{"'])
def test_a_cut_input_reads_as_the_anthropic_sdk_reads_it_streamed(text: str) -> None:
    expected = jiter.from_json(text.encode(), partial_mode=True) if text else {}
    assert written_object(text) == expected


# ------------------------------------------------------------------ the three routes


SCRIPT = FORCED["hermes"]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_script(SCRIPT) as served:
        yield served


def tokens_to(served: Served, text: str) -> int:
    return len(served.tokenizer.encode(text, add_special_tokens=False))


def cuts(served: Served) -> dict[str, tuple[int, list[bool]]]:
    """max_tokens cutting the script, and which calls the answer then holds (complete or not): inside the
    first call's name, right after the first call, inside the second call's arguments, and with the second
    call's arguments written but the call not closed."""
    second = SCRIPT.index("<tool_call>", 1)
    return {"in the first name": (tokens_to(served, '<tool_call>\n{"na'), []),
            "after the first call": (tokens_to(served, SCRIPT[:second]), [True]),
            "in the arguments": (tokens_to(served, SCRIPT[:second] + '<tool_call>\n{"name": "get_weather", '
                                                   '"arguments": {"city": "Ro'), [True, False]),
            "before the close": (tokens_to(served, SCRIPT.removesuffix("\n</tool_call>")), [True, False])}


def same_calls(whole: list[tuple[str, str]], streamed: list[tuple[str, str]], complete: list[bool]) -> bool:
    """Whether two lists of (name, arguments) are the calls `complete` says, alike: complete ones as JSON
    (a plain answer re-serialises them), the cut one as the text sent."""
    assert len(whole) == len(streamed) == len(complete)
    return all(w[0] == s[0] == "get_weather" and arguments_of(w[1], done) == arguments_of(s[1], done)
               for w, s, done in zip(whole, streamed, complete))


def test_chat_completions_agree_on_a_cut_off_forced_call(served: Served) -> None:
    for where, (cut, complete) in cuts(served).items():
        request = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=cut)
        choice = served.client().chat.completions.create(**request).choices[0]
        content, calls, finish = "", {}, None
        for chunk in served.client().chat.completions.create(**request, stream=True):
            for part in chunk.choices:
                content += part.delta.content or ""
                for piece in part.delta.tool_calls or []:
                    name, text = calls.get(piece.index, (None, ""))
                    calls[piece.index] = (name or piece.function.name, text + (piece.function.arguments or ""))
                finish = part.finish_reason or finish
        assert choice.finish_reason == finish == "length", where
        assert choice.message.content is None and content == "", where
        whole = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
        assert same_calls(whole, list(calls.values()), complete), where
        assert [json.loads(a) for (_, a), done in zip(whole, complete) if done] == ARGS[:sum(complete)], where


def test_responses_agree_on_a_cut_off_forced_call(served: Served) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}]
    for where, (cut, complete) in cuts(served).items():
        request = dict(model="tiny", input="Weather?", tools=tools, tool_choice="required", max_output_tokens=cut)
        whole = served.client().responses.create(**request)
        events = list(served.client().responses.create(**request, stream=True))
        final = events[-1].response
        assert events[-1].type == "response.incomplete" and whole.status == final.status == "incomplete", where
        kinds = ["function_call"] * len(complete) or ["message"]
        assert [item.type for item in whole.output] == [item.type for item in final.output] == kinds, where
        statuses = ["completed" if done else "incomplete" for done in complete]
        calls = [item for item in whole.output if item.type == "function_call"]
        streamed_calls = [item for item in final.output if item.type == "function_call"]
        assert [c.status for c in calls] == [c.status for c in streamed_calls] == statuses, where
        assert same_calls([(c.name, c.arguments) for c in calls], [(c.name, c.arguments) for c in streamed_calls],
                          complete), where
        done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        assert [(i.arguments, i.status) for i in done] == [(c.arguments, c.status) for c in streamed_calls], where


def test_messages_agree_on_a_cut_off_forced_call(served: Served) -> None:
    sdk = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    request = dict(model="tiny", messages=ASK, tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
                   tool_choice={"type": "any"})
    for where, (cut, complete) in cuts(served).items():
        whole = sdk.messages.create(max_tokens=cut, **request)
        with sdk.messages.stream(max_tokens=cut, **request) as stream:
            final = stream.get_final_message()
        assert whole.stop_reason == final.stop_reason == "max_tokens", where
        blocks = [(b.type, getattr(b, "name", None), getattr(b, "input", getattr(b, "text", None)))
                  for b in whole.content]
        assert blocks == [(b.type, getattr(b, "name", None), getattr(b, "input", getattr(b, "text", None)))
                          for b in final.content], where
        calls = [b for b in whole.content if b.type == "tool_use"]
        assert len(calls) == len(complete) and all(c.input == a for c, a, done in zip(calls, ARGS, complete) if done)
        assert "<tool_call>" not in json.dumps(blocks), where
