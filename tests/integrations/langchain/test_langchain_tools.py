"""Tool calls and structured output for ChatPaged: parsing, forced calls, streaming, and LangChain's
standard tests.

The standard suite runs on the default weights with HERMES_TOOL_TEMPLATE, a ChatML template that
renders tools Hermes/Qwen style (the default model's own template ignores them). Forced calls
(tool_choice "any"/a name, and structured output) are held by the engine to a grammar built from the
tools (a bound name, arguments valid against the tool's schema), which is what makes a 135M model's
calls parseable. Where the model's output is still not a usable call, the standard test is
overridden and marked xfail with the reason: test_agent_loop.

Skipped groups, and why (as in test_langchain_chat_standard.py): image, audio, video and PDF
inputs, image and PDF tool messages, Anthropic-format inputs (ChatPaged is text only); per-call
model override (refused); the VCR stream-time benchmark (network models only).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_tests.integration_tests import ChatModelIntegrationTests
from paged_backend.integrations.langchain import (
    HERMES_TOOL_TEMPLATE,
    ChatPaged,
    get_async_engine,
)
from paged_backend.integrations.langchain.messages import to_chat_dicts
from paged_backend.integrations.langchain.tool_calls import (
    ContentStreamer,
    parse_hermes,
    parse_with_tokenizer,
)
from paged_backend.entrypoints.structured import chosen_tool_name, forced_tool_spec
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

# Slow tier: compiles models or runs a whole client suite; `-m "not slow"` leaves it out (CI runs it).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place.",
           "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                          "required": ["location"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two ints.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}}
QWEN_RESPONSE_TEMPLATE = {  # transformers' Qwen2 response template, as a tokenizer would ship it
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>)", "content": "text"},
    },
}


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "It's sunny."


# ---------------------------------------------------------------------- parsing, no model


def test_parse_hermes_splits_calls_from_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": "{\\"location\\": \\"Paris\\"}"}\n</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2}),
                                                                   ("get_weather", {"location": "Paris"})]
    assert len({c["id"] for c in parsed.tool_calls}) == 2 and not parsed.invalid_tool_calls


def test_parse_hermes_keeps_broken_calls_as_invalid() -> None:
    parsed = parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>')
    assert parsed.tool_calls == [] and parsed.invalid_tool_calls[0]["error"].startswith("JSONDecodeError")
    unclosed = parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert unclosed.tool_calls[0]["args"] == {"a": 1, "b": 2}


def test_content_streamer_never_releases_a_tool_call() -> None:
    streamer = ContentStreamer()
    text = ' Sure <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> done'
    released = "".join(streamer.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    parsed = parse_hermes(text)
    assert released == "Sure"
    assert released + streamer.finish(parsed.content) == parsed.content == "Sure  done"


def accepts(tokenizer: Any, spec, text: str) -> bool:
    """Whether `text` is a complete answer under the spec's grammar."""
    import xgrammar

    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer))
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(spec.grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def call(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_a_forced_call_grammar_allows_only_bound_tools_and_their_arguments(tokenizer: Any) -> None:
    some_tool = forced_tool_spec([ADD, WEATHER], "any")
    assert accepts(tokenizer, some_tool, call("add", {"a": 1, "b": -2}))
    assert accepts(tokenizer, some_tool, call("get_weather", {"location": 'Paris "centre"'}))
    assert not accepts(tokenizer, some_tool, call("subtract", {"a": 1, "b": 2}))
    assert not accepts(tokenizer, some_tool, call("add", {"a": 1.5, "b": 2}))
    assert not accepts(tokenizer, some_tool, call("add", {"a": 1}))
    named = forced_tool_spec([ADD, WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert not accepts(tokenizer, named, call("add", {"a": 1, "b": 2}))
    no_args = {"type": "function", "function": {"name": "ping"}}
    assert accepts(tokenizer, forced_tool_spec([no_args], "ping"), call("ping", {}))
    assert forced_tool_spec([ADD], "auto") is None and forced_tool_spec([ADD], None) is None


def test_required_tools_allow_several_calls_and_a_named_tool_one(tokenizer: Any) -> None:
    two = call("add", {"a": 1, "b": 2}) + "\n" + call("get_weather", {"location": "Oslo"})
    assert accepts(tokenizer, forced_tool_spec([ADD, WEATHER], "required"), two)
    assert not accepts(tokenizer, forced_tool_spec([ADD, WEATHER], "required", parallel=False), two)
    assert not accepts(tokenizer, forced_tool_spec([ADD, WEATHER], "add"), call("add", {"a": 1, "b": 2}) * 2)
    assert not accepts(tokenizer, forced_tool_spec([ADD, WEATHER], "required"), "")
    with pytest.raises(ValueError, match="parameters of tool 'bad'"):
        forced_tool_spec([{"type": "function", "function": {"name": "bad", "parameters": {"type": "nope"}}}], "bad")


def test_tool_choice_names_the_forced_tool() -> None:
    assert chosen_tool_name([ADD], "any") == "" and chosen_tool_name([ADD, WEATHER], "required") == ""
    assert chosen_tool_name([ADD, WEATHER], {"type": "function", "function": {"name": "add"}}) == "add"
    assert chosen_tool_name([ADD, WEATHER], None) is chosen_tool_name([ADD], "auto") is None
    with pytest.raises(ValueError, match="names no bound tool"):
        chosen_tool_name([ADD], "subtract")


def test_messages_merge_same_roles_but_not_tool_results() -> None:
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}
    chat = to_chat_dicts([SystemMessage("a"), SystemMessage("b"), HumanMessage("q"), AIMessage("", tool_calls=[call]),
                          ToolMessage("3", tool_call_id="c1"), ToolMessage("4", tool_call_id="c2")])
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "tool"]
    assert chat[0]["content"] == "a\n\nb"
    assert chat[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}


def test_image_blocks_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="'image' content blocks"):
        to_chat_dicts([HumanMessage([{"type": "image", "url": "http://x/y.png"}])])


# ---------------------------------------------------------------------- on the default weights


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_async_engine().engine.tokenizer


def test_tokenizer_response_parser_is_used_where_present(tokenizer: Any) -> None:
    with_parser = copy.copy(tokenizer)
    with_parser.response_template = QWEN_RESPONSE_TEMPLATE
    text = 'Hi\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    parsed = parse_with_tokenizer(with_parser, text, "<|im_start|>assistant\n", [ADD])
    assert parsed.content == "Hi" and parsed.tool_calls[0]["args"] == {"a": 1, "b": 2}


def test_a_template_without_tools_gets_the_hermes_tool_prompt(tokenizer: Any) -> None:
    """The default model's template ignores tools: they are described in the system turn (the shared
    tool policy), past calls and results written as Hermes text, and the answer still parses."""
    model = ChatPaged(temperature=0, max_tokens=48)
    history = [SystemMessage("Be brief."), HumanMessage("What is the weather in Paris?"),
               AIMessage("", tool_calls=[{"name": "get_weather", "args": {"location": "Paris"}, "id": "c1"}]),
               ToolMessage("18 C", tool_call_id="c1")]
    call = model.prepare(history, None, {"tools": [convert_to_openai_tool(get_weather)]})
    system = call.prompt_text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "<tools>" in system
    assert '"name": "get_weather"' in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>' in call.prompt_text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in call.prompt_text
    message = model.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"


def test_tools_reach_the_prompt_and_a_forced_call_parses(tokenizer: Any) -> None:
    model = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=48)
    call = model.prepare([HumanMessage("What is the weather in Paris?")], None,
                         {"tools": [convert_to_openai_tool(get_weather)], "tool_choice": "get_weather"})
    assert '"name": "get_weather"' in call.prompt_text and "<tools>" in call.prompt_text
    assert call.params.structured_outputs == forced_tool_spec([convert_to_openai_tool(get_weather)], "get_weather")
    message = model.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["location"], str)


def test_streamed_tool_call_matches_invoke() -> None:
    model = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=48).bind_tools(
        [get_weather], tool_choice="any")
    invoked = model.invoke("What is the weather in Paris?")
    chunks = list(model.stream("What is the weather in Paris?"))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert isinstance(full, AIMessageChunk) and chunks[-1].chunk_position == "last"
    assert [c["args"] for c in full.tool_calls] == [c["args"] for c in invoked.tool_calls]
    assert full.content == invoked.content
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    # The call streams as it is written: its name first, then its arguments piece by piece.
    pieces = [p for c in chunks for p in c.tool_call_chunks]
    assert pieces[0]["name"] == "get_weather" and pieces[0]["id"] and pieces[0]["args"] == ""
    assert sum(1 for p in pieces if p["args"]) > 2


def test_a_forced_call_is_one_call_unless_parallel_calls_are_allowed() -> None:
    question = "What is the weather in Paris and in Rome?"
    model = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=96)
    one = model.bind_tools([get_weather], tool_choice="any").invoke(question)
    both = model.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=True).invoke(question)
    assert [c["args"] for c in one.tool_calls] == [{"location": "Paris"}]
    assert [c["args"] for c in both.tool_calls] == [{"location": "Paris"}, {"location": "Rome"}]


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name")
    age: int = Field(description="the person's age in years")


class Pet(BaseModel):
    kind: str = Field(description="cat or dog", max_length=8)
    name: str = Field(max_length=12)


class Household(BaseModel):
    """A household."""

    owner: Person
    pets: list[Pet] = Field(max_length=2)
    rooms: int | str


class Movie(TypedDict):
    title: str
    year: int


STORY = "Alice is 30 years old. She lives in a 3-room flat with her cat Tom."


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_with_nested_models_and_unions(method: str) -> None:
    model = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=120)
    result = model.with_structured_output(Household, method=method, include_raw=True).invoke(STORY)
    assert result["parsing_error"] is None, result["raw"]
    assert isinstance(result["parsed"], Household) and isinstance(result["parsed"].owner, Person)


def test_function_calling_structured_output_forces_one_named_call_with_bound_options() -> None:
    binding = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE).with_structured_output(Person, max_tokens=7).first
    assert binding.kwargs["tool_choice"] == "Person" and binding.kwargs["max_tokens"] == 7


def test_structured_output_of_a_typed_dict_and_json_mode() -> None:
    model = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=60)
    movie = model.with_structured_output(Movie, method="json_schema").invoke("Name a movie from 1999.")
    assert set(movie) == {"title", "year"} and isinstance(movie["year"], int)
    free = model.with_structured_output(None, method="json_mode").invoke("Describe a movie as JSON.")
    assert isinstance(free, dict)


def test_structured_output_through_a_json_schema() -> None:
    model = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=48)
    structured = model.with_structured_output(Person.model_json_schema(), method="json_schema", include_raw=True)
    result = structured.invoke("Alice is 30 years old. Extract the person.")
    assert result["raw"].content.startswith("{")
    assert result["parsing_error"] is None, result["raw"].content
    assert set(result["parsed"]) == {"name", "age"}
    # Too few max_tokens for the whole answer: the call says it ran out (the answer is the cut JSON).
    short = ChatPaged(chat_template=HERMES_TOOL_TEMPLATE, temperature=0, max_tokens=2).with_structured_output(
        Person.model_json_schema(), method="json_schema", include_raw=True).invoke("Alice is 30 years old.")
    assert short["raw"].response_metadata["finish_reason"] == "length"
    assert result["raw"].content.startswith(short["raw"].content)
    assert short["raw"].usage_metadata["output_tokens"] == 2


async def test_structured_answers_with_n_samples_use_derived_seeds() -> None:
    fmt = {"type": "json_schema", "json_schema": {"schema": Person.model_json_schema()}}
    prompt = [HumanMessage("Alice is 30 years old. Extract the person.")]
    options = {"chat_template": HERMES_TOOL_TEMPLATE, "temperature": 1.0, "max_tokens": 48}
    result = ChatPaged(n=3, seed=3, **options).generate([prompt], response_format=fmt)
    texts = [g.message.content for g in result.generations[0]]
    assert len(texts) == 3 and len(set(texts)) > 1 and all(set(json.loads(t)) == {"name", "age"} for t in texts)
    assert ChatPaged(seed=5, **options).invoke(prompt, response_format=fmt).content == texts[2]  # seed + 2
    again = await ChatPaged(n=3, seed=3, **options).agenerate([prompt], response_format=fmt)
    assert [g.message.content for g in again.generations[0]] == texts
    with pytest.raises(ValueError, match="cannot be combined"):
        ChatPaged(structured_outputs={"regex": "a"}, **options).invoke(prompt, response_format=fmt)


# ---------------------------------------------------------------------- the standard suite


class TestChatPagedTools(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPaged]:
        return ChatPaged

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # max_tokens may sit here: the integration suite never passes it (see the other file).
        # Enough tokens for a whole forced call: a call cut by max_tokens does not parse.
        return {"chat_template": HERMES_TOOL_TEMPLATE, "temperature": 0, "max_tokens": 96}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def structured_output_kwargs(self) -> dict[str, Any]:
        # The suite's Joke schema has free strings, and the greedy 135M model repeats itself inside one
        # until max_tokens cuts the answer; a frequency penalty, as one would set for so small a model,
        # lets it close them.
        return {"frequency_penalty": 1.0}

    @property
    def supports_json_mode(self) -> bool:
        # json_mode does not see the schema, and the greedy 135M model nests the suite's keys wrongly
        # (`{"setup": {"punchline": ...}}`). json_mode is tested above with a free object.
        return False

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(reason="left to choose (tool_choice=None), the 135M model answers in prose instead of "
                              "calling the weather tool", strict=True, raises=AssertionError)
    def test_agent_loop(self, model: ChatPaged) -> None:
        super().test_agent_loop(model)
