"""ChatPaged and reasoning models: the thinking comes back as LangChain expects it
(additional_kwargs["reasoning_content"], hence a leading reasoning content block), streamed too, with
its tokens in usage; tool calls are parsed from the answer only, in the model's format; the thinking
budget and template kwargs reach the engine and the template. Answers are scripted into a tiny random
model whose tokenizer has the markers (helpers/scripted.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.langchain_chat import chat, joined
from helpers.scripted import ScriptedClient, marker_tokenizer, tiny_llm
from langchain_core.messages import HumanMessage

from paged_backend import AsyncEngine

pytestmark = pytest.mark.timeout(120)

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
            "{% endif %}{% endif %}")
THOUGHT = "<think>\nThe user greets me.</think>\n\nHello there, friend!"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
HELLO = [HumanMessage("Say hello.")]


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedClient]:
    tokenizer = marker_tokenizer([THOUGHT, CALL, LLAMA_CALL, " yes Done."] * 3, TEMPLATE)
    aengine = AsyncEngine(tiny_llm(tokenizer).engine)
    yield ScriptedClient(aengine, anchor="</think>")
    aengine.shutdown()


def test_the_thinking_is_reasoning_content_and_a_reasoning_block(scripted: ScriptedClient) -> None:
    reply = chat(scripted, THOUGHT).invoke(HELLO)
    assert reply.content == "Hello there, friend!"
    assert reply.additional_kwargs["reasoning_content"] == "The user greets me."
    assert reply.content_blocks[0] == {"type": "reasoning", "reasoning": "The user greets me."}
    thinking = len(scripted.tokenizer.encode("<think>\nThe user greets me.</think>", add_special_tokens=False))
    assert reply.usage_metadata["output_token_details"]["reasoning"] == thinking


def test_a_stream_carries_the_same_split(scripted: ScriptedClient) -> None:
    chunks = list(chat(scripted, THOUGHT).stream(HELLO))
    total = joined(chunks)
    assert total.content == "Hello there, friend!"
    assert total.additional_kwargs["reasoning_content"] == "The user greets me."
    assert not any("think>" in chunk.content for chunk in chunks)
    assert sum(1 for c in chunks if c.additional_kwargs.get("reasoning_content")) > 1  # it streamed in pieces
    assert total.usage_metadata["output_token_details"]["reasoning"] > 0


async def test_async_calls_split_alike(scripted: ScriptedClient) -> None:
    reply = await chat(scripted, THOUGHT).ainvoke(HELLO)
    chunks = [chunk async for chunk in chat(scripted, THOUGHT).astream(HELLO)]
    assert (reply.content, reply.additional_kwargs["reasoning_content"]) == \
        (joined(chunks).content, joined(chunks).additional_kwargs["reasoning_content"])


def test_tool_calls_come_from_the_answer(scripted: ScriptedClient) -> None:
    model = chat(scripted, "<think>I need the weather.</think>\n" + CALL).bind_tools([WEATHER])
    reply = model.invoke(HELLO)
    assert reply.additional_kwargs["reasoning_content"] == "I need the weather."
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    streamed = joined(list(model.stream(HELLO)))
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert streamed.additional_kwargs["reasoning_content"] == "I need the weather."


def test_a_tool_with_a_broken_schema_is_refused_at_binding(scripted: ScriptedClient) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "objct"}}}
    with pytest.raises(ValueError, match=r"tools\[1\] \('f'\): its parameters are not a valid JSON schema"):
        chat(scripted, CALL).bind_tools([WEATHER, broken])


def test_a_forced_call_after_the_thinking_and_a_blank_line(scripted: ScriptedClient) -> None:
    model = chat(scripted, "<think>I need the weather.</think>\n\n" + CALL).bind_tools([WEATHER], tool_choice="any")
    assert [(c["name"], c["args"]) for c in model.invoke(HELLO).tool_calls] == [("get_weather", {"city": "Paris"})]


def test_a_named_tool_call_format(scripted: ScriptedClient) -> None:
    model = chat(scripted, LLAMA_CALL, tool_call_parser="llama3_json").bind_tools([WEATHER])
    assert [(c["name"], c["args"]) for c in model.invoke(HELLO).tool_calls] == [("get_weather", {"city": "Paris"})]
    assert [(c["name"], c["args"]) for c in joined(list(model.stream(HELLO))).tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    with pytest.raises(ValueError, match="tool_call_parser='nope'"):
        chat(scripted, LLAMA_CALL, tool_call_parser="nope").bind_tools([WEATHER]).invoke(HELLO)


def test_the_budget_and_the_template_kwargs(scripted: ScriptedClient) -> None:
    script = "<think>" + " yes" * 30 + "</think>Done."
    reply = chat(scripted, script, thinking_token_budget=4).invoke(HELLO)
    assert (reply.additional_kwargs["reasoning_content"], reply.content) == ("yes yes yes yes", "Done.")
    on = chat(scripted, "Hi.").invoke(HELLO)
    off = chat(scripted, "Hi.", chat_template_kwargs={"enable_thinking": False}).invoke(HELLO)
    closed = len(scripted.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.usage_metadata["input_tokens"] == on.usage_metadata["input_tokens"] + closed
    assert "reasoning_content" not in off.additional_kwargs
    plain = chat(scripted, THOUGHT, reasoning_parser=None).invoke(HELLO)
    assert plain.content == THOUGHT and "reasoning_content" not in plain.additional_kwargs
    with pytest.raises(ValueError, match="thinking_token_budget"):
        chat(scripted, "x", reasoning_parser=None, thinking_token_budget=3).invoke(HELLO)
