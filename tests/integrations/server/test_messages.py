"""/v1/messages (Anthropic's Messages API) with request shapes from Anthropic's documentation over plain
HTTP, and through the `anthropic` SDK (create, stream), against a tiny model trained to answer scripted
conversations (helpers/scripted_chat.py): text, a weather tool call, and the answer after its result."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from helpers.scripted_chat import HELLO_ANSWER, SUNNY_ANSWER, WEATHER, scripted_llm
from helpers.server import Served, serve, wait_all_blocks_free

pytestmark = pytest.mark.timeout(180)

KEY = "test-key"
TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": WEATHER["function"]["parameters"]}
PARIS = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny() -> Iterator[Served]:
    with serve(scripted_llm(), "tiny", api_key=KEY) as served:
        yield served


def post(served: Served, path: str = "/v1/messages", key: str = KEY, **body) -> httpx.Response:
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    defaults = {"model": "tiny"} | ({"max_tokens": 64} if path == "/v1/messages" else {})
    return httpx.post(f"{served.url}{path}", json=defaults | body, headers=headers, timeout=60)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sdk(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0)


def events_of(reply: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events = []
    for frame in reply.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_text_answer_in_anthropics_shape(tiny: Served) -> None:
    reply = post(tiny, messages=user("Say hello."), tools=[TOOL], temperature=0)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "text", "text": HELLO_ANSWER}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["usage"]["input_tokens"] > 0 and message["usage"]["output_tokens"] > 0


def test_tool_use_and_tool_result_round_trip(tiny: Served) -> None:
    first = post(tiny, messages=user(PARIS), tools=[TOOL], temperature=0).json()
    [block] = first["content"]
    assert first["stop_reason"] == "tool_use"
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": "Paris"}
    assert block["id"].startswith("toolu_")
    conversation = user(PARIS) + [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}]}]
    second = post(tiny, messages=conversation, tools=[TOOL], temperature=0).json()
    assert second["content"] == [{"type": "text", "text": SUNNY_ANSWER}] and second["stop_reason"] == "end_turn"


def test_stream_has_anthropics_event_sequence(tiny: Served) -> None:
    reply = post(tiny, messages=user("Say hello."), tools=[TOOL], temperature=0, stream=True)
    events = events_of(reply)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["input_tokens"] > 0
    deltas = [data["delta"]["text"] for name, data in events if name == "content_block_delta"]
    assert len(deltas) > 2 and "".join(deltas) == HELLO_ANSWER
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_streamed_tool_calls_are_tool_use_blocks(tiny: Served) -> None:
    reply = post(tiny, messages=user("Weather in Rome and Oslo?"), tools=[TOOL], temperature=0, stream=True)
    events = events_of(reply)
    starts = [data for name, data in events if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"], s["content_block"]["name"]) for s in starts] == \
        [(0, "tool_use", "get_weather"), (1, "tool_use", "get_weather")]
    inputs = ["".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == i)
              for i in (0, 1)]
    assert [json.loads(i) for i in inputs] == [{"city": "Rome"}, {"city": "Oslo"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_sdk_create_and_stream(tiny: Served) -> None:
    client = sdk(tiny)
    # This SDK has no temperature argument any more; the server still takes the field (greedy here).
    message = client.messages.create(model="tiny", max_tokens=64, messages=user("Say hello."), tools=[TOOL],
                                     extra_body=GREEDY)
    assert message.content[0].text == HELLO_ANSWER and message.stop_reason == "end_turn"
    with client.messages.stream(model="tiny", max_tokens=64, messages=user("Say hello."), tools=[TOOL],
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == HELLO_ANSWER == final.content[0].text


def test_sdk_forced_tool_streams_its_input(tiny: Served) -> None:
    with sdk(tiny).messages.stream(model="tiny", max_tokens=64, messages=user("Weather in Rome and Oslo?"),
                                   tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body=GREEDY) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    [block] = final.content
    assert block.type == "tool_use" and block.input == {"city": "Rome"} and final.stop_reason == "tool_use"
    assert len(pieces) > 2  # piece by piece


def test_system_max_tokens_stop_sequences_and_count_tokens(tiny: Served) -> None:
    plain = post(tiny, path="/v1/messages/count_tokens", messages=user("Say hello.")).json()
    system = post(tiny, path="/v1/messages/count_tokens", messages=user("Say hello."), system="Be brief.").json()
    assert system["input_tokens"] > plain["input_tokens"] > 0
    blocks = post(tiny, path="/v1/messages/count_tokens", messages=user("Say hello."),
                  system=[{"type": "text", "text": "Be brief."}]).json()
    assert blocks == system
    cut = post(tiny, messages=user("Say hello."), tools=[TOOL], temperature=0, max_tokens=2).json()
    assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 2
    stopped = post(tiny, messages=user("Say hello."), tools=[TOOL], temperature=0, stop_sequences=["there"]).json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "there"
    assert stopped["content"][0]["text"] == "Hello "


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
    ({"tools": [TOOL | {"input_schema": {"type": "object", "required": "city"}}]}, "tools.0.input_schema"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_bad_requests_are_400_in_anthropics_shape(tiny: Served, body: dict, field: str) -> None:
    reply = post(tiny, **({"messages": user("hi")} | body))
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]
    wait_all_blocks_free(tiny.aengine)


def test_key_by_header_or_bearer(tiny: Served) -> None:
    assert post(tiny, key="wrong", messages=user("hi")).json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{tiny.url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": user("hi")},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=tiny.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=user("hi"))
    with pytest.raises(anthropic.NotFoundError):
        sdk(tiny).messages.create(model="other", max_tokens=2, messages=user("hi"))
