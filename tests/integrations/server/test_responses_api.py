"""/v1/responses through the real `openai` SDK (create, create(stream=True), responses.stream) and
LangChain's `ChatOpenAI(use_responses_api=True)`, against a tiny model trained to answer scripted
conversations (helpers/scripted_chat.py): plain text, a weather tool call, and the answer after the tool's
result. Errors are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.scripted_chat import HELLO_ANSWER, SUNNY_ANSWER, WEATHER, scripted_llm
from helpers.server import Served, serve, wait_all_blocks_free
from paged_backend.integrations.server.response_store import ResponseStore

pytestmark = pytest.mark.timeout(180)

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
PARIS = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def tiny() -> Iterator[Served]:
    with serve(scripted_llm(), "tiny", max_stored_responses=4) as served:
        yield served


def create(served: Served, **kwargs):
    return served.client().responses.create(model="tiny", temperature=0, **kwargs)


def test_text_input_answers_with_one_message(tiny: Served) -> None:
    response = create(tiny, input="Say hello.", tools=[TOOL])
    assert response.status == "completed" and response.output_text == HELLO_ANSWER
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.usage.output_tokens > 0 and response.usage.total_tokens == \
        response.usage.input_tokens + response.usage.output_tokens
    assert response.id.startswith("resp_") and response.model == "tiny"


def test_items_input_equals_text_input(tiny: Served) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]
    assert create(tiny, input=items, tools=[TOOL]).output_text == HELLO_ANSWER


def test_instructions_become_the_system_turn(tiny: Served) -> None:
    plain = create(tiny, input="Say hello.")
    instructed = create(tiny, input="Say hello.", instructions="Be brief.")
    assert instructed.usage.input_tokens > plain.usage.input_tokens


def test_max_output_tokens_makes_an_incomplete_response(tiny: Served) -> None:
    response = create(tiny, input="Say hello.", tools=[TOOL], max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and HELLO_ANSWER.startswith(response.output_text)


def test_function_call_and_its_output_in_a_follow_up(tiny: Served) -> None:
    first = create(tiny, input=PARIS, tools=[TOOL])
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    # The whole conversation resent as items ...
    items = [{"role": "user", "content": PARIS}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    assert create(tiny, input=items, tools=[TOOL]).output_text == SUNNY_ANSWER
    # ... or continued from the stored response.
    follow_up = create(tiny, previous_response_id=first.id, tools=[TOOL],
                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow_up.output_text == SUNNY_ANSWER and follow_up.previous_response_id == first.id


def test_stream_events_build_the_same_response(tiny: Served) -> None:
    whole = create(tiny, input="Say hello.", tools=[TOOL])
    events = list(create(tiny, input="Say hello.", tools=[TOOL], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == HELLO_ANSWER
    assert events[-1].response.output_text == whole.output_text
    assert kinds.count("response.output_text.delta") > 2  # piece by piece


def test_streamed_function_call(tiny: Served) -> None:
    events = list(create(tiny, input="Weather in Rome and Oslo?", tools=[TOOL], stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, json.loads(i.arguments)) for i in done] == \
        [("function_call", {"city": "Rome"}), ("function_call", {"city": "Oslo"})]
    assert not [e for e in events if e.type == "response.output_text.delta"]  # no half call leaks as text
    final = events[-1].response
    assert [i.call_id for i in final.output] == [i.call_id for i in done]


def test_forced_call_streams_its_arguments_piece_by_piece(tiny: Served) -> None:
    with tiny.client().responses.stream(model="tiny", input="Weather in Rome and Oslo?", tools=[TOOL],
                                        tool_choice="required", parallel_tool_calls=False, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and json.loads("".join(deltas)) == {"city": "Rome"}
    [call] = final.output
    assert call.type == "function_call" and call.arguments == "".join(deltas)


def test_named_tool_choice_and_json_schema_are_held_by_the_grammar(tiny: Served) -> None:
    named = create(tiny, input="Say hello.", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    [call] = named.output
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city"}
    # An enum leaves the untrained model no room for free whitespace, so the answer completes.
    schema = {"type": "string", "enum": ["yes", "no"]}
    structured = create(tiny, input="Say hello.", max_output_tokens=40,
                        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert structured.status == "completed" and json.loads(structured.output_text) in ("yes", "no")


def test_responses_stream_helper_gives_the_final_text(tiny: Served) -> None:
    with tiny.client().responses.stream(model="tiny", input="Say hello.", tools=[TOOL], temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == HELLO_ANSWER


def test_stored_responses_are_read_deleted_and_evicted(tiny: Served) -> None:
    client = tiny.client()
    first = create(tiny, input="Say hello.")
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = create(tiny, input="Say hello.", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(4):  # the store holds 4: the first is evicted
        create(tiny, input="Say hello.")
    with pytest.raises(openai.BadRequestError) as error:
        create(tiny, input="hi", previous_response_id=first.id)
    assert error.value.body["param"] == "previous_response_id"
    latest = create(tiny, input="Say hello.")
    client.responses.delete(latest.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(latest.id)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [TOOL, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.1.type"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [TOOL | {"parameters": {"type": "object", "properties": [1]}}]}, "tools.0.parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Say hello. " * 400}, "input"),
    ({"temperature": 3.0}, "temperature"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_unsupported_or_bad_fields_are_400_naming_the_field(tiny: Served, kwargs: dict, param: str) -> None:
    body = {"model": "tiny", "input": "Say hello."} | kwargs
    reply = httpx.post(f"{tiny.url}/v1/responses", json=body, headers={"Authorization": "Bearer x"}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    wait_all_blocks_free(tiny.aengine)


def test_the_serve_command_sizes_the_store(monkeypatch) -> None:
    import argparse

    from paged_backend.integrations.server import cli
    from paged_backend.integrations.server.lifecycle import Lifecycle

    from paged_backend.entrypoints import async_engine, llm

    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    assert parser.parse_args([]).max_stored_responses == 1024

    class FakeLLM:
        def __init__(self, *args, **kwargs) -> None:
            self.engine = None

        def close(self) -> None:
            pass

    class FakeAsyncEngine:
        def __init__(self, engine) -> None:
            pass

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(llm, "LLM", FakeLLM)  # the server's command builds them from their modules
    monkeypatch.setattr(async_engine, "AsyncEngine", FakeAsyncEngine)
    lifecycle = Lifecycle(drain_timeout=1.0)
    loaded: dict = {}
    cli.load_then_serve(parser.parse_args(["--max-stored-responses", "7"]), lifecycle, None, loaded)
    assert "error" not in loaded
    assert lifecycle.app.state.responses.max_responses == 7


def test_response_store_is_bounded_least_recently_used_first() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    got = store.get("a")
    got.conversation.append({"role": "user"})
    assert store.get("a").conversation == []  # callers get copies
    assert len(ResponseStore(max_responses=0).entries) == 0


# ------------------------------------------------------------------ LangChain's ChatOpenAI on the Responses API

def chat_openai(served: Served):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny", base_url=f"{served.url}/v1", api_key="x", temperature=0,
                      use_responses_api=True, max_retries=0)


def test_langchain_plain_and_streamed(tiny: Served) -> None:
    llm = chat_openai(tiny).bind_tools([WEATHER])  # the scripted answers were learnt with the tool offered
    reply = llm.invoke("Say hello.")
    assert reply.text == HELLO_ANSWER and reply.response_metadata["model_name"] == "tiny"
    chunks = list(llm.stream("Say hello."))
    assert "".join(c.text for c in chunks) == HELLO_ANSWER
    assert sum(1 for c in chunks if c.text) > 2


def test_langchain_tool_calling_round_trip(tiny: Served) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_openai(tiny).bind_tools([WEATHER])
    question = HumanMessage(PARIS)
    called = llm.invoke([question])
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    answer = llm.invoke([question, called, ToolMessage("sunny", tool_call_id=call["id"])])
    assert answer.text == SUNNY_ANSWER and not answer.tool_calls
