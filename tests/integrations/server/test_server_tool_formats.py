"""Tool-call formats through the server, with the openai SDK: each family's own call text (scripted
into a tiny random model whose tokenizer has the markers, helpers/scripted.py) comes back as
`tool_calls`, streamed and not alike; a malformed call comes back as text; tool_choice "required" and
a named tool hold the random model itself to each format's grammar, so its call is valid JSON for
the tool's schema. The format is read from each model's chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from helpers.scripted import ScriptedClient, marker_tokenizer, tiny_llm, with_template
from helpers.server import Served, serve

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
PARIS, ROME = {"city": "Paris", "unit": "celsius"}, {"city": "Rome", "unit": "celsius"}


def template(marker: str) -> str:
    """ChatML that shows the tools and names the family's call marker, as the families' templates do."""
    return ("{% if tools %}{{ '<|im_start|>system\nCall tools with " + marker + ": ' + (tools | tojson) + "
            "'<|im_end|>\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
            "(m['content'] or '') + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# family: (the marker its template names, an answer calling get_weather twice, content, a malformed answer)
FAMILIES = {
    "hermes": ("<tool_call>",
               ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'
               "\n</tool_call>"), "Checking.",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}\n</tool_call>'),
    "llama3_json": ("<|python_tag|>",
                    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'), None,
                    '{"name": "get_weather", "parameters": {"city": "Paris"}} is what I would call'),
    "mistral": ("[TOOL_CALLS]",
                ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]'), "Checking.",
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"'),
    "qwen3_coder": ("<tool_call><function=",
                    ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=unit>\ncelsius\n"
                    "</parameter>\n</function>\n</tool_call>"), "Checking.",
                    "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
}
CORPUS = [answer for _, answer, _, _ in FAMILIES.values()] * 3 + [json.dumps(TOOLS)] * 3


@pytest.fixture(scope="module")
def tokenizer():
    return marker_tokenizer(CORPUS, template("<tool_call>"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tokenizer) -> Iterator[tuple[str, Served]]:
    name = request.param
    llm = tiny_llm(with_template(tokenizer, template(FAMILIES[name][0])))
    with serve(llm, "tiny", wrap=ScriptedClient) as served:  # the format is the template's: auto
        yield name, served


def create(served: Served, script: str | None, **kwargs):
    served.app_client.script = script
    return served.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0,
                                                   max_tokens=kwargs.pop("max_tokens", 120), **kwargs)


def streamed_calls(chunks) -> tuple[str, dict[int, tuple[str, str]], str | None]:
    """(content, {index: (name, arguments text)}, finish reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                name, text = calls.get(piece.index, (None, ""))
                calls[piece.index] = (name or piece.function.name, text + (piece.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_each_family_calls_come_back_as_tool_calls(family) -> None:
    name, served = family
    _, answer, content, _ = FAMILIES[name]
    choice = create(served, answer).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", PARIS), ("get_weather", ROME)]
    streamed_content, calls, finish = streamed_calls(create(served, answer, stream=True))
    assert finish == "tool_calls" and streamed_content.strip() == (content or "")
    assert [(n, json.loads(text)) for n, text in (calls[i] for i in sorted(calls))] == \
        [("get_weather", PARIS), ("get_weather", ROME)]
    only_one = create(served, answer, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in only_one] == [PARIS]


def test_a_malformed_call_comes_back_as_text(family) -> None:
    name, served = family
    broken = FAMILIES[name][3]
    choice = create(served, broken).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == broken
    content, calls, finish = streamed_calls(create(served, broken, stream=True))
    assert (content, calls, finish) == (broken, {}, "stop")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_follow_the_format_and_the_schema(family, tool_choice) -> None:
    _, served = family
    for stream in (False, True):
        if stream:
            _, calls, finish = streamed_calls(create(served, None, tool_choice=tool_choice, stream=True,
                                                     parallel_tool_calls=False))
            got = [calls[i] for i in sorted(calls)]
        else:
            choice = create(served, None, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
            finish, got = choice.finish_reason, [(c.function.name, c.function.arguments)
                                                for c in choice.message.tool_calls]
        assert finish == "tool_calls" and len(got) == 1
        [(tool_name, arguments)] = got
        if isinstance(tool_choice, dict):
            assert tool_name == "get_time"
        schema = next(t for t in TOOLS if t["function"]["name"] == tool_name)["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)
