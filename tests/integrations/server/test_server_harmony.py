"""gpt-oss's harmony format through the server, with the openai SDK: a tiny random model whose tokenizer
has harmony's markers as special tokens (and stops at `<|call|>` as gpt-oss does) writes scripted
harmony answers (helpers/scripted.py); both parsers are read from its gpt-oss-like template. The analysis
channel comes back as `reasoning`, the final channel as `content`, a call to functions.NAME as a tool
call with finish_reason "tool_calls", on /v1/chat/completions (streamed and not) and /v1/responses; no
markup reaches the content; a malformed call is text; a forced call is held to harmony's call form."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from helpers.scripted import HARMONY_MARKERS, ScriptedClient, harmony_llm, harmony_tokenizer
from helpers.server import Served, serve

pytestmark = pytest.mark.timeout(180)

TEMPLATE = ("{% if tools %}{{ '<|start|>developer<|message|># Tools\n' + (tools | tojson) + '<|end|>' }}{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ '<|start|>functions.' + (m['name'] or 'tool') + ' to=assistant<|channel|>commentary<|message|>' }}"
            "{% else %}{{ '<|start|>' + m['role'] + '<|message|>' }}{% endif %}"
            "{{ (m['content'] or '') + '<|end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
THINKING, ANSWER = "The user greets me. I greet back.", "Hello there, friend!"
THOUGHT = f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
BROKEN = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par'
CORPUS = [THOUGHT, CALL, json.dumps(TOOLS), "UTC CET Rome"] * 3


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer(CORPUS, TEMPLATE)


@pytest.fixture(scope="module")
def served(tokenizer) -> Iterator[Served]:
    with serve(harmony_llm(tokenizer), "tiny", wrap=ScriptedClient) as served:  # both parsers: auto
        yield served


def ask(served: Served, script: str | None, **kwargs):
    served.app_client.script = script
    return served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   temperature=0, max_tokens=kwargs.pop("max_tokens", 80), **kwargs)


def streamed(served: Served, script: str | None, **kwargs) -> tuple[str, str, dict[int, tuple[str, str]], str]:
    """(reasoning, content, {index: (name, arguments text)}, finish reason) of a stream."""
    reasoning = content = ""
    calls, finish = {}, None
    for chunk in ask(served, script, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                name, text = calls.get(piece.index, (None, ""))
                calls[piece.index] = (name or piece.function.name, text + (piece.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_analysis_is_reasoning_and_final_is_content(served: Served) -> None:
    choice = ask(served, THOUGHT).choices[0]
    assert (choice.message.model_extra["reasoning"], choice.message.content) == (THINKING, ANSWER)
    assert choice.message.model_extra["reasoning_content"] == THINKING and choice.finish_reason == "stop"
    assert streamed(served, THOUGHT) == (THINKING, ANSWER, {}, "stop")
    reply = ask(served, THOUGHT)
    # the analysis message, header to terminator; `<|start|>assistant` opens the final message
    thinking = len(served.tokenizer.encode(f"<|channel|>analysis<|message|>{THINKING}<|end|>", add_special_tokens=False))
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking


def test_a_call_ends_the_turn_as_tool_calls(served: Served) -> None:
    choice = ask(served, CALL, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == "Need the weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    reasoning, content, calls, finish = streamed(served, CALL, tools=TOOLS)
    assert (reasoning, content, finish) == ("Need the weather.", "", "tool_calls")
    assert [(name, json.loads(text)) for name, text in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_a_malformed_call_is_text_and_no_markup_leaks(served: Served) -> None:
    choice = ask(served, BROKEN, tools=TOOLS).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop" and choice.message.content == BROKEN
    assert streamed(served, BROKEN, tools=TOOLS)[1:] == (BROKEN, {}, "stop")
    for script in (THOUGHT, THOUGHT + "<|return|>", "<|channel|>final<|message|>Plain."):
        content = ask(served, script).choices[0].message.content
        assert not any(marker in content for marker in HARMONY_MARKERS)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_takes_harmony_s_form(served: Served, tool_choice) -> None:
    # gpt-oss's own form (thinking, then the call) is what the grammar holds: a token it refused would fail
    script = CALL if tool_choice == "required" else CALL.replace("get_weather", "get_time").replace(
        '{"city": "Paris"}', '{"zone": "UTC"}')
    choice = ask(served, script, tools=TOOLS, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _, _, calls, finish = streamed(served, script, tools=TOOLS, tool_choice=tool_choice)
    assert finish == "tool_calls" and [name for name, _ in calls.values()] == [choice.message.tool_calls[0].function.name]


@pytest.fixture(scope="module")
def unthinking(tokenizer) -> Iterator[Served]:
    """The random model on its own (no script), its thinking not split: the grammar alone makes its call."""
    with serve(harmony_llm(tokenizer), "tiny", reasoning_parser="none", wrap=ScriptedClient) as served:
        yield served


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_the_grammar_holds_a_random_model_to_a_valid_call(unthinking: Served, tool_choice) -> None:
    choice = ask(unthinking, None, tools=TOOLS, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_responses_give_a_reasoning_item_and_a_function_call(served: Served) -> None:
    client = served.client()
    served.app_client.script = THOUGHT
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=80)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert "".join(part.text for part in response.output[0].content) == THINKING and response.output_text == ANSWER
    served.app_client.script = CALL
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    for reply in (client.responses.create(model="tiny", input="Weather?", tools=[tool], max_output_tokens=80),
                  list(client.responses.create(model="tiny", input="Weather?", tools=[tool], max_output_tokens=80,
                                               stream=True))[-1].response):
        calls = [item for item in reply.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
        assert reply.output[0].type == "reasoning" and reply.output_text == ""


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}
JSON_ANSWER = ('<|channel|>analysis<|message|>They want JSON.<|end|><|start|>assistant<|channel|>final<|message|>'
               '{"city": "Rome"}')


def test_a_json_answer_is_held_after_the_final_channel_s_header(served: Served) -> None:
    # gpt-oss writes its final channel's header before a JSON answer too: a grammar that began the JSON
    # right after the thinking would refuse the header (a request error) and push the model off its format
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    choice = ask(served, JSON_ANSWER, response_format=fmt).choices[0]
    assert (choice.message.model_extra["reasoning"], json.loads(choice.message.content)) == \
        ("They want JSON.", {"city": "Rome"})
    served.app_client.script = JSON_ANSWER
    reply = served.client().responses.create(model="tiny", input="Where?", max_output_tokens=80, text={
        "format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert json.loads(reply.output_text) == {"city": "Rome"} and reply.output[0].type == "reasoning"

