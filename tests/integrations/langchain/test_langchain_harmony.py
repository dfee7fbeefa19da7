"""ChatPaged and gpt-oss's harmony format: the analysis channel comes back as reasoning content, the final
channel as content, a call to functions.NAME as a tool call, invoked and streamed alike, with both parsers
read from the template. Answers are scripted into a tiny random model whose tokenizer has harmony's
markers as special tokens (helpers/scripted.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.langchain_chat import chat, joined
from helpers.scripted import (
    HARMONY_MARKERS,
    ScriptedClient,
    harmony_llm,
    harmony_tokenizer,
)
from langchain_core.messages import HumanMessage

from paged_backend import AsyncEngine

pytestmark = pytest.mark.timeout(120)

TEMPLATE = ("{% for m in messages %}{{ '<|start|>' + m['role'] }}{% if m['role'] == 'assistant' %}"
            "{{ '<|channel|>final' }}{% endif %}{{ '<|message|>' + (m['content'] or '') + '<|end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
THOUGHT = ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final<|message|>"
           "Hello there, friend!")
CALL = ('<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
HELLO = [HumanMessage("Say hello.")]


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedClient]:
    aengine = AsyncEngine(harmony_llm(harmony_tokenizer([THOUGHT, CALL] * 3, TEMPLATE)).engine)
    yield ScriptedClient(aengine)
    aengine.shutdown()


def test_analysis_is_reasoning_content_final_is_content(scripted: ScriptedClient) -> None:
    reply = chat(scripted, THOUGHT).invoke(HELLO)
    assert (reply.content, reply.additional_kwargs["reasoning_content"]) == ("Hello there, friend!", "The user greets me.")
    chunks = list(chat(scripted, THOUGHT).stream(HELLO))
    total = joined(chunks)
    assert (total.content, total.additional_kwargs["reasoning_content"]) == ("Hello there, friend!", "The user greets me.")
    assert not any(marker in chunk.content for chunk in chunks for marker in HARMONY_MARKERS)


def test_a_call_is_a_tool_call(scripted: ScriptedClient) -> None:
    model = chat(scripted, CALL).bind_tools([WEATHER])
    for reply in (model.invoke(HELLO), joined(list(model.stream(HELLO)))):
        assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert reply.additional_kwargs["reasoning_content"] == "I need the weather." and not reply.content
        assert reply.response_metadata["finish_reason"] == "stop"  # LangChain's own: the call is in tool_calls
    forced = chat(scripted, CALL).bind_tools([WEATHER], tool_choice="get_weather")
    assert [(c["name"], c["args"]) for c in forced.invoke(HELLO).tool_calls] == [("get_weather", {"city": "Paris"})]


def test_structured_output_follows_the_final_channel_s_header(scripted: ScriptedClient) -> None:
    # gpt-oss opens its answer with the final channel's header, JSON or not: the schema holds what follows it
    script = ('<|channel|>analysis<|message|>They want JSON.<|end|><|start|>assistant<|channel|>final<|message|>'
              '{"city": "Paris"}')
    schema = {"title": "weather", "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    model = chat(scripted, script).with_structured_output(schema, method="json_schema", include_raw=True)
    reply = model.invoke(HELLO)
    assert reply["parsed"] == {"city": "Paris"} and reply["raw"].additional_kwargs["reasoning_content"] == \
        "They want JSON."
