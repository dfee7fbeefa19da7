"""Reasoning models through the server, with the openai SDK: the thinking in `reasoning` (and
`reasoning_content`), the answer in `content`, streamed and not alike; the thinking budget; template
kwargs; tool calls and structured outputs on the answer only; usage's reasoning tokens.

A tiny random model whose tokenizer has `<think>` and `</think>` writes scripted answers
(helpers/scripted.py): a random model would never write the markers itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.scripted import ScriptedClient, marker_tokenizer, tiny_llm, with_template
from helpers.server import Served, serve
from paged_backend.integrations.server import create_app
from paged_backend.integrations.server.cli import add_serve_arguments

pytestmark = pytest.mark.timeout(120)

CHATML = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}{% endfor %}"
# Qwen3's way: the model opens <think> itself; enable_thinking=false closes an empty one in the prompt.
QWEN3_LIKE = (CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
              "{% endif %}{% endif %}")
# DeepSeek-R1's way: the prompt opens the thinking.
R1_LIKE = CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"

THOUGHT = "<think>\nThe user greets me. I greet back.</think>\n\nHello there, friend!"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HELLO = [{"role": "user", "content": "Say hello."}]
CORPUS = [THOUGHT, CALL, "I think. Answer. yes yes yes Done.", '{"answer": "yes"}'] * 3


@pytest.fixture(scope="module")
def qwen3() -> Iterator[Served]:
    tokenizer = marker_tokenizer(CORPUS, QWEN3_LIKE)
    with serve(tiny_llm(tokenizer), "tiny", wrap=lambda c: ScriptedClient(c, anchor="</think>")) as served:
        yield served


@pytest.fixture(scope="module")
def r1() -> Iterator[Served]:
    tokenizer = marker_tokenizer(CORPUS, R1_LIKE)
    with serve(tiny_llm(tokenizer), "tiny", reasoning_parser="deepseek_r1", wrap=ScriptedClient) as served:
        yield served


def ask(served: Served, script: str, **kwargs):
    served.app_client.script = script
    return served.client().chat.completions.create(model="tiny", messages=kwargs.pop("messages", HELLO),
                                                   temperature=0, max_tokens=kwargs.pop("max_tokens", 80), **kwargs)


def ask_streamed(served: Served, script: str, **kwargs) -> tuple[str, str, list]:
    """(reasoning, content, chunks) of a streamed answer; checks that reasoning_content mirrors reasoning."""
    chunks = list(ask(served, script, stream=True, stream_options={"include_usage": True}, **kwargs))
    reasoning = content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += choice.delta.content or ""
    return reasoning, content, chunks


def test_thinking_goes_to_reasoning_and_the_answer_to_content(qwen3: Served) -> None:
    reply = ask(qwen3, THOUGHT)
    message = reply.choices[0].message
    assert message.content == "Hello there, friend!"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == \
        "The user greets me. I greet back."
    thinking = len(qwen3.tokenizer.encode("<think>\nThe user greets me. I greet back.</think>",
                                          add_special_tokens=False))
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking
    assert reply.usage.completion_tokens > thinking


def test_a_stream_splits_as_the_plain_answer_does(qwen3: Served) -> None:
    reasoning, content, chunks = ask_streamed(qwen3, THOUGHT)
    assert (reasoning, content) == ("The user greets me. I greet back.", "Hello there, friend!")
    assert not any(marker in (c.choices[0].delta.content or "") for c in chunks if c.choices
                   for marker in ("<think>", "</think>"))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("script", ["No thinking at all.", "<think>unclosed thought", "<think></think>Fast.",
                                    "Before <think>mid</think> after", "<think>a</think>b</think>c<think>"])
def test_any_answer_splits_alike_streamed_or_not_and_content_shows_no_marker(qwen3: Served, script: str) -> None:
    message = ask(qwen3, script).choices[0].message
    reasoning, content, _ = ask_streamed(qwen3, script)
    assert (message.model_extra["reasoning"] or "", message.content or "") == (reasoning, content)
    assert "<think>" not in content and "</think>" not in content


def test_a_prompt_that_opens_the_thinking(r1: Served) -> None:
    message = ask(r1, "I think.</think>Answer.").choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("I think.", "Answer.")
    assert ask_streamed(r1, "I think.</think>Answer.")[:2] == ("I think.", "Answer.")
    unfinished = ask(r1, "Still thinking", max_tokens=3)  # cut by max_tokens: all thinking, no content
    assert unfinished.choices[0].message.content is None
    assert unfinished.usage.completion_tokens_details.reasoning_tokens == unfinished.usage.completion_tokens


def test_chat_template_kwargs_reach_the_template(qwen3: Served) -> None:
    thinking_on = ask(qwen3, "Hi.")
    thinking_off = ask(qwen3, "Hi.", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed = len(qwen3.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert thinking_off.usage.prompt_tokens == thinking_on.usage.prompt_tokens + closed
    assert thinking_off.choices[0].message.content == "Hi."
    assert thinking_off.choices[0].message.model_extra["reasoning"] is None


def test_thinking_token_budget_closes_the_thinking_and_the_answer_follows(qwen3: Served) -> None:
    script = "<think>" + " yes" * 40 + "</think>Done."
    reply = ask(qwen3, script, extra_body={"thinking_token_budget": 5})
    message = reply.choices[0].message
    assert message.model_extra["reasoning"] == " ".join(["yes"] * 5) and message.content == "Done."
    assert reply.usage.completion_tokens_details.reasoning_tokens == 1 + 5 + 1  # <think>, 5 tokens, </think>
    reasoning, content, _ = ask_streamed(qwen3, script, extra_body={"thinking_token_budget": 5})
    assert (reasoning, content) == (message.model_extra["reasoning"], "Done.")
    unbounded = ask(qwen3, script, max_tokens=200).choices[0].message
    assert unbounded.model_extra["reasoning"] == " ".join(["yes"] * 40)
    none_at_all = ask(qwen3, script, extra_body={"thinking_token_budget": 0}).choices[0].message
    assert (none_at_all.model_extra["reasoning"], none_at_all.content) == ("", "Done.")


def test_tool_calls_are_parsed_from_the_answer_only(qwen3: Served) -> None:
    reply = ask(qwen3, "<think>Need the weather.</think>\n" + CALL, tools=[WEATHER])
    message = reply.choices[0].message
    assert message.model_extra["reasoning"] == "Need the weather." and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert reply.choices[0].finish_reason == "tool_calls"
    _, _, chunks = ask_streamed(qwen3, "<think>Need the weather.</think>\n" + CALL, tools=[WEATHER])
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["get_weather"]
    # A call-like text inside the thinking is thinking, not a call.
    inner = ask(qwen3, "<think>maybe " + CALL + "</think>No call.", tools=[WEATHER]).choices[0].message
    assert inner.tool_calls is None and inner.content == "No call." and CALL in inner.model_extra["reasoning"]


def test_structured_outputs_hold_the_answer_after_the_thinking(qwen3: Served) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    format_ = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    # The grammar lets the thinking be any text (here, broken JSON) and holds the answer after it; a
    # scripted token the grammar refused would fail the request.
    reply = ask(qwen3, '<think>{not json</think>{"answer": "yes"}', response_format=format_)
    message = reply.choices[0].message
    assert message.model_extra["reasoning"] == "{not json" and json.loads(message.content) == {"answer": "yes"}
    assert reply.choices[0].finish_reason == "stop"


def test_bad_reasoning_options_name_their_field(qwen3: Served, r1: Served) -> None:
    with pytest.raises(ValueError, match="reasoning_parser='nope'"):
        create_app(qwen3.aengine, "tiny", reasoning_parser="nope")
    with pytest.raises(ValueError, match="tool_call_parser='nope'"):
        create_app(qwen3.aengine, "tiny", tool_call_parser="nope")
    with pytest.raises(openai.BadRequestError) as caught:
        ask(qwen3, "x", extra_body={"thinking_token_budget": -1})
    assert caught.value.body["param"] == "thinking_token_budget"
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "nope"])


def test_a_budget_without_a_reasoning_parser_is_a_400() -> None:
    tokenizer = marker_tokenizer(CORPUS, CHATML + "{{ '<|im_start|>assistant\n' }}")
    with serve(tiny_llm(tokenizer), "tiny") as served:
        response = httpx.post(f"{served.url}/v1/chat/completions", json={
            "model": "tiny", "messages": HELLO, "max_tokens": 2, "thinking_token_budget": 4})
        assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_token_budget"
        plain = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "tiny", "messages": HELLO,
                                                                       "max_tokens": 2}).json()
        assert "reasoning" not in plain["choices"][0]["message"]  # no reasoning parser: the old shape
        assert "completion_tokens_details" not in plain["usage"]


def test_reasoning_parser_none_leaves_the_text_alone(qwen3: Served) -> None:
    unsplit = ask(qwen3, THOUGHT, extra_body={"include_reasoning": False}).choices[0].message
    assert unsplit.content == THOUGHT and "reasoning" not in unsplit.model_extra
    with serve(tiny_llm(with_template(qwen3.tokenizer, QWEN3_LIKE)), "tiny", reasoning_parser="none",
               wrap=ScriptedClient) as served:
        assert ask(served, THOUGHT).choices[0].message.content == THOUGHT


@pytest.mark.parametrize("gap", ["", "\n\n", " \n"])
def test_the_answer_grammar_lets_whitespace_follow_the_thinking(qwen3: Served, gap: str) -> None:
    # Qwen3 writes "</think>\n\n" before its answer: a forced call or a schema must accept that gap.
    forced = ask(qwen3, f"<think>Need the weather.</think>{gap}" + CALL, tools=[WEATHER], tool_choice="required")
    calls = forced.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    format_ = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    held = ask(qwen3, f'<think>Say yes.</think>{gap}{{"answer": "yes"}}', response_format=format_)
    assert json.loads(held.choices[0].message.content) == {"answer": "yes"}
