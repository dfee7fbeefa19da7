"""One reading of an assistant turn on every chat-shaped route: /v1/responses (openai SDK) and
/v1/messages (anthropic SDK) split a reasoning model's thinking from its answer as
/v1/chat/completions does (a reasoning item / thinking blocks, streamed as the SDKs' reasoning events),
count the thinking, map their thinking options onto the model's own switch, and read tool calls in the
server's tool-call format.

Tiny random models whose tokenizers have the markers write scripted answers (helpers/scripted.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from helpers.scripted import ScriptedClient, marker_tokenizer, tiny_llm, with_template
from helpers.server import Served, serve

pytestmark = pytest.mark.timeout(180)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
          "{% endfor %}")
QWEN3_LIKE = (CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
              "{% endif %}{% endif %}")
R1_LIKE = CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"

THINKING, ANSWER = "The user greets me. I greet back.", "Hello there, friend!"
THOUGHT = f"<think>\n{THINKING}</think>\n\n{ANSWER}"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER_SCHEMA}
CORPUS = [THOUGHT, CALL, "I think. Answer. yes yes yes Done.", "Before mid after"] * 3
SCRIPTS = [THOUGHT, "No thinking at all.", "<think>unclosed thought", "<think></think>Fast.",
           "<think>a</think>b</think>c<think>"]
MARKERS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def qwen3() -> Iterator[Served]:
    tokenizer = marker_tokenizer(CORPUS, QWEN3_LIKE)
    with serve(tiny_llm(tokenizer), "tiny", wrap=lambda c: ScriptedClient(c, anchor="</think>")) as served:
        yield served


def thinking_tokens(served: Served, thinking: str) -> int:
    return len(served.tokenizer.encode(f"<think>\n{thinking}</think>", add_special_tokens=False))


# ------------------------------------------------------------------ /v1/responses


def respond(served: Served, script: str, **kwargs):
    served.app_client.script = script
    return served.client().responses.create(model="tiny", input=kwargs.pop("input", "Say hello."),
                                            max_output_tokens=kwargs.pop("max_output_tokens", 80), **kwargs)


def response_parts(response) -> tuple[str | None, str, list]:
    """(reasoning text or None, output text, function calls) of a response; the reasoning item first."""
    kinds = [item.type for item in response.output]
    reasoning = None
    if "reasoning" in kinds:
        assert kinds.index("reasoning") == 0 and kinds.count("reasoning") == 1
        item = response.output[0]
        assert item.summary == [] and item.status == "completed" and item.id.startswith("rs_")
        reasoning = "".join(part.text for part in item.content)
    calls = [item for item in response.output if item.type == "function_call"]
    return reasoning, response.output_text, calls


def streamed_response(served: Served, script: str, **kwargs):
    """(reasoning deltas joined, text deltas joined, the events)."""
    events = list(respond(served, script, stream=True, **kwargs))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return reasoning, text, events


def test_responses_return_a_reasoning_item_before_the_message(qwen3: Served) -> None:
    response = respond(qwen3, THOUGHT)
    assert response_parts(response) == (THINKING, ANSWER, [])
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.output_tokens_details.reasoning_tokens == thinking_tokens(qwen3, THINKING)
    assert response.usage.output_tokens > response.usage.output_tokens_details.reasoning_tokens


def test_responses_stream_the_sdks_reasoning_events(qwen3: Served) -> None:
    reasoning, text, events = streamed_response(qwen3, THOUGHT)
    assert (reasoning, text) == (THINKING, ANSWER)
    kinds = [e.type for e in events]
    first = kinds.index("response.reasoning_text.delta")
    assert kinds[2:first] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    closing = ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    at = kinds.index("response.reasoning_text.done")
    assert kinds[at:at + 3] == closing and events[at].text == THINKING
    assert at < kinds.index("response.output_text.delta")  # the thinking closes before the answer opens
    final = events[-1].response
    assert response_parts(final) == (THINKING, ANSWER, [])
    assert final.usage.output_tokens_details.reasoning_tokens == thinking_tokens(qwen3, THINKING)


@pytest.mark.parametrize("script", SCRIPTS)
def test_responses_split_alike_streamed_or_not(qwen3: Served, script: str) -> None:
    reasoning, text, _ = response_parts(respond(qwen3, script))
    assert streamed_response(qwen3, script)[:2] == (reasoning or "", text)
    assert not any(marker in text for marker in MARKERS)


def test_responses_reasoning_effort_none_turns_the_thinking_off(qwen3: Served) -> None:
    on = respond(qwen3, "Hi.")
    off = respond(qwen3, "Hi.", reasoning={"effort": "none"})
    closed = len(qwen3.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.usage.input_tokens == on.usage.input_tokens + closed
    assert [item.type for item in off.output] == ["message"] and off.output_text == "Hi."
    assert off.reasoning.effort == "none"


@pytest.mark.parametrize(("reasoning", "param"), [({"effort": "high"}, "reasoning.effort"),
                                                  ({"summary": "brief"}, "reasoning.summary"),
                                                  ({"generate_summary": 1}, "reasoning.generate_summary"),
                                                  ({"nope": 1}, "reasoning.nope")])
def test_responses_reasoning_options_it_cannot_honour_are_400(qwen3: Served, reasoning: dict, param: str) -> None:
    reply = httpx.post(f"{qwen3.url}/v1/responses", json={"model": "tiny", "input": "hi", "reasoning": reasoning},
                       timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_a_summary_asked_for_carries_the_thinking_verbatim(qwen3: Served) -> None:
    response = respond(qwen3, THOUGHT, reasoning={"summary": "auto"})
    item = response.output[0]
    assert item.type == "reasoning" and [part.text for part in item.summary] == [THINKING] and not item.content
    assert response.output_text == ANSWER and response.reasoning.summary == "auto"
    events = list(respond(qwen3, THOUGHT, stream=True, reasoning={"summary": "detailed"}))
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == THINKING
    assert "response.reasoning_text.delta" not in kinds
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index("response.reasoning_summary_part.done")
    final = events[-1].response.output[0]
    assert [part.text for part in final.summary] == [THINKING] and not final.content


def test_responses_tool_calls_come_from_the_answer_only(qwen3: Served) -> None:
    script = "<think>Need the weather.</think>\n" + CALL
    for response in (respond(qwen3, script, tools=[RESPONSES_TOOL]),
                     streamed_response(qwen3, script, tools=[RESPONSES_TOOL])[2][-1].response):
        reasoning, text, calls = response_parts(response)
        assert (reasoning, text) == ("Need the weather.", "")
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    inner = respond(qwen3, "<think>maybe " + CALL + "</think>No call.", tools=[RESPONSES_TOOL])
    assert response_parts(inner)[1:] == ("No call.", [])


def test_responses_json_format_holds_the_answer_after_the_thinking(qwen3: Served) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    text = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    # The grammar lets the thinking be any text (here, broken JSON); a scripted token it refused would
    # fail the request.
    response = respond(qwen3, '<think>{not json</think>{"answer": "yes"}', text=text)
    reasoning, answer, _ = response_parts(response)
    assert response.status == "completed" and reasoning == "{not json" and json.loads(answer) == {"answer": "yes"}


# ------------------------------------------------------------------ /v1/messages


def sdk(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)


def message(served: Served, script: str, **kwargs):
    served.app_client.script = script
    return sdk(served).messages.create(model="tiny", max_tokens=kwargs.pop("max_tokens", 80),
                                       messages=[{"role": "user", "content": "Say hello."}], **kwargs)


def streamed_message(served: Served, script: str, **kwargs):
    """(thinking deltas joined, text deltas joined, the final message)."""
    served.app_client.script = script
    with sdk(served).messages.stream(model="tiny", max_tokens=kwargs.pop("max_tokens", 80),
                                     messages=[{"role": "user", "content": "Say hello."}], **kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    thinking = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    text = "".join(d.text for d in deltas if d.type == "text_delta")
    return thinking, text, final


def blocks_of(reply) -> tuple[str | None, str]:
    """(thinking or None, text) of a message; a thinking block comes first."""
    kinds = [block.type for block in reply.content]
    thinking = None
    if "thinking" in kinds:
        assert kinds.index("thinking") == 0 and kinds.count("thinking") == 1
        thinking = reply.content[0].thinking
    return thinking, "".join(block.text for block in reply.content if block.type == "text")


def test_messages_return_a_thinking_block_before_the_text(qwen3: Served) -> None:
    reply = message(qwen3, THOUGHT)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert blocks_of(reply) == (THINKING, ANSWER) and reply.stop_reason == "end_turn"
    thinking, text, final = streamed_message(qwen3, THOUGHT)
    assert (thinking, text) == (THINKING, ANSWER)
    assert [block.type for block in final.content] == ["thinking", "text"] and blocks_of(final) == (THINKING, ANSWER)


@pytest.mark.parametrize("script", SCRIPTS)
def test_messages_split_alike_streamed_or_not(qwen3: Served, script: str) -> None:
    thinking, text = blocks_of(message(qwen3, script))
    assert streamed_message(qwen3, script)[:2] == (thinking or "", text)
    assert not any(marker in text for marker in MARKERS)


def test_messages_thinking_options_map_onto_the_model(qwen3: Served) -> None:
    script = "<think>" + " yes" * 40 + "</think>Done."
    budgeted = message(qwen3, script, thinking={"type": "enabled", "budget_tokens": 5})
    assert blocks_of(budgeted) == (" ".join(["yes"] * 5), "Done.")
    assert streamed_message(qwen3, script, thinking={"type": "enabled", "budget_tokens": 5})[:2] == \
        (" ".join(["yes"] * 5), "Done.")
    on = message(qwen3, "Hi.", thinking={"type": "adaptive"})
    off = message(qwen3, "Hi.", thinking={"type": "disabled"})
    closed = len(qwen3.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.usage.input_tokens == on.usage.input_tokens + closed
    assert blocks_of(off) == (None, "Hi.")
    for bad, param in [({"type": "enabled"}, "thinking.budget_tokens"), ({"type": "sometimes"}, "thinking.type"),
                       ({"type": "enabled", "budget_tokens": 9, "display": "omitted"}, "thinking.display")]:
        with pytest.raises(anthropic.BadRequestError, match=param):
            message(qwen3, "Hi.", thinking=bad)


def test_messages_tool_calls_come_from_the_answer_only(qwen3: Served) -> None:
    script = "<think>Need the weather.</think>\n" + CALL
    reply = message(qwen3, script, tools=[ANTHROPIC_TOOL])
    assert [block.type for block in reply.content] == ["thinking", "tool_use"] and reply.stop_reason == "tool_use"
    assert reply.content[1].input == {"city": "Paris"}
    thinking, text, final = streamed_message(qwen3, script, tools=[ANTHROPIC_TOOL])
    assert (thinking, text) == ("Need the weather.", "")
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == \
        [("thinking", None), ("tool_use", {"city": "Paris"})]


def test_messages_forced_call_follows_the_thinking(qwen3: Served) -> None:
    script = "<think>Need the weather.</think>" + CALL  # the grammar holds the call right after the thinking
    any_tool = {"type": "any", "disable_parallel_tool_use": True}
    reply = message(qwen3, script, tools=[ANTHROPIC_TOOL], tool_choice=any_tool)
    assert [(b.type, getattr(b, "input", None)) for b in reply.content] == \
        [("thinking", None), ("tool_use", {"city": "Paris"})]
    thinking, _, final = streamed_message(qwen3, script, tools=[ANTHROPIC_TOOL], tool_choice=any_tool)
    assert thinking == "Need the weather." and final.content[1].input == {"city": "Paris"}


# ------------------------------------------------------------------ a template without the switch


def test_thinking_off_without_a_template_switch_closes_it_at_once() -> None:
    """DeepSeek-R1's template opens the thinking and reads no enable_thinking: off is a budget of 0."""
    tokenizer = marker_tokenizer(CORPUS, R1_LIKE)
    with serve(tiny_llm(tokenizer), "tiny", reasoning_parser="deepseek_r1",
               wrap=lambda c: ScriptedClient(c, anchor="</think>")) as served:
        thought = respond(served, "I think.</think>Answer.")
        assert response_parts(thought)[:2] == ("I think.", "Answer.")
        off = respond(served, "I think.</think>Answer.", reasoning={"effort": "none"})
        assert [item.type for item in off.output] == ["message"] and off.output_text == "Answer."
        assert off.usage.output_tokens_details.reasoning_tokens == 1  # the end marker, forced at once
        assert blocks_of(message(served, "I think.</think>Answer.", thinking={"type": "disabled"})) == \
            (None, "Answer.")


def test_a_server_without_a_reasoning_parser_refuses_thinking_options() -> None:
    tokenizer = marker_tokenizer(CORPUS, CHATML + "{{ '<|im_start|>assistant\n' }}")
    with serve(tiny_llm(tokenizer), "tiny", wrap=ScriptedClient) as served:
        reply = httpx.post(f"{served.url}/v1/responses", json={"model": "tiny", "input": "hi",
                                                               "reasoning": {"effort": "none"}}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning"
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            message(served, "Hi.", thinking={"type": "enabled", "budget_tokens": 8})
        assert blocks_of(message(served, "Hi.", thinking={"type": "disabled"})) == (None, "Hi.")
        plain = respond(served, THOUGHT)  # no parser: the text is left alone
        assert [item.type for item in plain.output] == ["message"] and plain.output_text == THOUGHT
        assert plain.usage.output_tokens_details.reasoning_tokens == 0


# ------------------------------------------------------------------ the server's tool-call format


FAMILIES = {  # family: (the marker its template names, an answer calling get_weather twice)
    "llama3_json": ("<|python_tag|>", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Rome"}}')),
    "mistral": ("[TOOL_CALLS]", ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                 '{"name": "get_weather", "arguments": {"city": "Rome"}}]')),
    "qwen3_coder": ("<tool_call><function=", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")),
}
CITIES = [{"city": "Paris"}, {"city": "Rome"}]


def tool_template(marker: str) -> str:
    return ("{% if tools %}{{ '<|im_start|>system\nCall tools with " + marker + ": ' + (tools | tojson) + "
            "'<|im_end|>\n' }}{% endif %}" + CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% endif %}")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> Iterator[tuple[str, Served]]:
    tokenizer = marker_tokenizer([answer for _, answer in FAMILIES.values()] * 3, tool_template("<tool_call>"))
    llm = tiny_llm(with_template(tokenizer, tool_template(FAMILIES[request.param][0])))
    with serve(llm, "tiny", wrap=ScriptedClient) as served:  # the format is read from the template
        yield request.param, served


def test_both_routes_read_calls_in_the_servers_format(family) -> None:
    name, served = family
    answer = FAMILIES[name][1]
    for response in (respond(served, answer, tools=[RESPONSES_TOOL]),
                     streamed_response(served, answer, tools=[RESPONSES_TOOL])[2][-1].response):
        _, text, calls = response_parts(response)
        assert text == "" and [json.loads(c.arguments) for c in calls] == CITIES
    reply = message(served, answer, tools=[ANTHROPIC_TOOL])
    assert [b.input for b in reply.content] == CITIES and reply.stop_reason == "tool_use"
    _, text, final = streamed_message(served, answer, tools=[ANTHROPIC_TOOL])
    assert text == "" and [b.input for b in final.content] == CITIES and final.stop_reason == "tool_use"


# A city the grammar holds to two names: the random model's call is then done in a few tokens, never cut
# off by max_tokens (which would leave it incomplete).
CITY_CHOICE = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}


def test_forced_calls_on_both_routes_follow_the_servers_format(family) -> None:
    _, served = family
    served.app_client.script = None  # the random model itself, held by the format's grammar
    forced = served.client().responses.create(model="tiny", input="Weather?",
                                              tools=[RESPONSES_TOOL | {"parameters": CITY_CHOICE}],
                                              tool_choice="required", parallel_tool_calls=False,
                                              max_output_tokens=120)
    [call] = forced.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert forced.status == call.status == "completed"
    reply = sdk(served).messages.create(model="tiny", max_tokens=120,
                                        tools=[ANTHROPIC_TOOL | {"input_schema": CITY_CHOICE}],
                                        messages=[{"role": "user", "content": "Weather?"}],
                                        tool_choice={"type": "tool", "name": "get_weather",
                                                     "disable_parallel_tool_use": True})
    [block] = reply.content
    assert block.type == "tool_use" and block.input["city"] in ("Paris", "Rome") and reply.stop_reason == "tool_use"


# ------------------------------------------------------------------ LangChain's ChatOpenAI on /v1/responses


def responses_chat_model(served: Served, script: str):
    """ChatOpenAI as its users set it for reasoning models: langchain-openai shows a reasoning item's summary
    (streamed or not) as the reasoning block, and only that."""
    from langchain_openai import ChatOpenAI

    served.app_client.script = script
    return ChatOpenAI(model="tiny", base_url=f"{served.url}/v1", api_key="x", temperature=0, max_tokens=80,
                      use_responses_api=True, reasoning={"summary": "auto"}, max_retries=0)


def reasoning_of(message) -> str:
    blocks = [block for block in message.content_blocks if block["type"] == "reasoning"]
    assert len(blocks) <= 1 and all(block["id"].startswith("rs_") for block in blocks)
    return "".join(block.get("reasoning", "") for block in blocks)


def test_chat_openai_on_responses_gets_reasoning_blocks_plain_and_streamed(qwen3: Served) -> None:
    reply = responses_chat_model(qwen3, THOUGHT).invoke("Say hello.")
    assert (reasoning_of(reply), reply.text) == (THINKING, ANSWER)
    chunks = list(responses_chat_model(qwen3, THOUGHT).stream("Say hello."))
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert (reasoning_of(total), total.text) == (THINKING, ANSWER)
    assert not any("think>" in chunk.text for chunk in chunks)


def test_chat_openai_on_responses_round_trips_a_call_made_after_thinking(qwen3: Served) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    question = HumanMessage("Weather in Paris?")
    model = responses_chat_model(qwen3, "<think>I need the weather.</think>\n\n" + CALL).bind_tools([RESPONSES_TOOL])
    called = model.invoke([question])
    assert reasoning_of(called) == "I need the weather."
    [call] = called.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    # The follow-up sends the reasoning item and the call back as input items.
    qwen3.app_client.script = f"<think>It is sunny.</think>\n\n{ANSWER}"
    answer = model.invoke([question, called, ToolMessage("sunny", tool_call_id=call["id"])])
    assert (reasoning_of(answer), answer.text, answer.tool_calls) == ("It is sunny.", ANSWER, [])
