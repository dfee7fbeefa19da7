"""One chat turn (paged_backend/entrypoints/chat_turn.py), as every chat front end builds it: the prompt,
the answer's grammar held after the thinking, the markers kept through decoding, the prompt check, the
thinking budget, and the reader that splits the answer, on small tokenizers."""

from __future__ import annotations

import pytest
from helpers.scripted import marker_tokenizer
from xgrammar.testing import _is_grammar_accept_string

from paged_backend import SamplingParams
from paged_backend.entrypoints.chat import render_chat
from paged_backend.entrypoints.chat_turn import ChatTurnError, NeedsReasoningModel, build_chat_turn
from paged_backend.entrypoints.reasoning import after_thinking, get_reasoning_parser
from paged_backend.entrypoints.structured import JSON_INSTRUCTION, forced_tool_spec
from paged_backend.entrypoints.tool_calls import HERMES, get_tool_parser
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# DeepSeek-R1's way: the generation prompt opens the thinking.
OPENS_THINKING = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}}
HELLO = [{"role": "user", "content": "Weather in Paris?"}]
R1 = get_reasoning_parser("deepseek_r1")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def chatml():
    return marker_tokenizer(["Weather in Paris? I think so. It is sunny. get_weather city"] * 3, CHATML)


@pytest.fixture(scope="module")
def thinking():
    return marker_tokenizer(["Weather in Paris? I think so. It is sunny. get_weather city"] * 3, OPENS_THINKING)


def test_the_prompt_is_the_shared_renderers(chatml) -> None:
    turn = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_parser=HERMES)
    assert turn.prompt_text == render_chat(chatml, HELLO, [WEATHER], tokenize=False)
    assert turn.prompt_ids == render_chat(chatml, HELLO, [WEATHER])
    assert turn.reader.tools == [WEATHER] and turn.reader.tool_parser is HERMES
    assert turn.params.structured_outputs is None and turn.processor is None


def test_tool_choice_none_shows_no_tools_and_reads_no_calls(chatml) -> None:
    turn = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_choice="none", tool_parser=HERMES)
    assert turn.prompt_text == render_chat(chatml, HELLO, None, tokenize=False)
    assert turn.reader.tool_parser is None and turn.reader.split(CALL)[1] == CALL


def test_a_forced_call_is_held_to_its_grammar_and_read_as_a_call(chatml) -> None:
    turn = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_choice="required", tool_parser=HERMES)
    assert turn.params.structured_outputs == forced_tool_spec([WEATHER], "required", True, HERMES)
    assert turn.reader.forced
    _, content, [call] = turn.reader.split(CALL)
    assert content is None and call.name == "get_weather"


def test_an_unknown_forced_tool_is_refused_naming_the_tools(chatml) -> None:
    with pytest.raises(ChatTurnError, match="names no bound tool") as refused:
        build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    assert refused.value.part == "tools"


def test_a_json_response_format_asks_for_json_and_holds_the_answer_to_it(chatml) -> None:
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}}
    turn = build_chat_turn(chatml, HELLO, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert JSON_INSTRUCTION in turn.prompt_text and '"sunny"' in turn.prompt_text
    assert turn.params.structured_outputs == StructuredOutputsParams(json=schema)
    with pytest.raises(ChatTurnError) as refused:
        build_chat_turn(chatml, HELLO, response_format={"type": "json_schema", "json_schema": {}})
    assert refused.value.part == "response_format"


def test_a_forced_call_comes_before_a_response_format_and_the_params_grammar(chatml) -> None:
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    forced = build_chat_turn(chatml, HELLO, params, tools=[WEATHER], tool_choice="required",
                             response_format={"type": "json_object"})
    assert forced.params.structured_outputs == forced_tool_spec([WEATHER], "required", True, HERMES)
    formatted = build_chat_turn(chatml, HELLO, params, response_format={"type": "json_object"})
    assert formatted.params.structured_outputs == StructuredOutputsParams(json_object=True)
    assert build_chat_turn(chatml, HELLO, params).params.structured_outputs == params.structured_outputs


def test_the_grammar_follows_the_thinking_the_prompt_opened(thinking) -> None:
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    turn = build_chat_turn(thinking, HELLO, params, reasoning=R1)
    assert turn.reader.opened
    assert turn.params.structured_outputs == after_thinking(params.structured_outputs, R1, True)
    grammar = turn.params.structured_outputs.grammar
    assert _is_grammar_accept_string(grammar, "I think so.</think>\n\nyes")
    assert not _is_grammar_accept_string(grammar, "yes")  # the opened thinking must close first


def test_a_forced_call_after_the_thinking_says_it_is_a_call(thinking, monkeypatch) -> None:
    from paged_backend.entrypoints import chat_turn

    seen = []
    monkeypatch.setattr(chat_turn, "after_thinking", lambda *args: seen.append(args) or args[0])
    build_chat_turn(thinking, HELLO, tools=[WEATHER], tool_choice="required", reasoning=R1, tool_parser=HERMES)
    build_chat_turn(thinking, HELLO, response_format={"type": "json_object"}, reasoning=R1)
    assert [(args[1:]) for args in seen] == [(R1, True, True), (R1, True, False)]


def test_an_unsplit_answer_still_holds_the_grammar_after_the_thinking(thinking) -> None:
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    turn = build_chat_turn(thinking, HELLO, params, reasoning=R1, split_reasoning=False)
    assert turn.reader.reasoning is None and turn.reader.opened
    assert turn.params.structured_outputs == after_thinking(params.structured_outputs, R1, True)
    assert turn.reader.split("I think.</think>yes") == (None, "I think.</think>yes", [])


def test_special_markers_keep_special_tokens_and_the_reader_drops_the_eos(chatml) -> None:
    eos = [chatml.eos_token_id]
    mistral = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_parser=get_tool_parser("mistral"),
                              eos_token_ids=eos)
    assert not mistral.params.skip_special_tokens and mistral.reader.eos_texts == ("<|im_end|>",)
    hermes = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_parser=HERMES, eos_token_ids=eos)
    assert hermes.params.skip_special_tokens and hermes.reader.eos_texts == ()
    left = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_parser=get_tool_parser("mistral"),
                           eos_token_ids=eos, keep_markers=False)
    assert left.params.skip_special_tokens and left.reader.eos_texts == ()


def test_the_prompt_check_sees_the_final_params_and_gives_the_ids(chatml) -> None:
    seen = []

    def check(ids: list[int], params: SamplingParams) -> list[int]:
        seen.append((ids, params))
        return ids[-3:]

    turn = build_chat_turn(chatml, HELLO, tools=[WEATHER], tool_choice="required", tool_parser=HERMES,
                           check_prompt=check)
    [(ids, params)] = seen
    assert params is turn.params and params.structured_outputs is not None
    assert turn.prompt_ids == ids[-3:] and len(ids) > 3


def test_the_thinking_budget_needs_a_reasoning_model_and_a_valid_budget(thinking) -> None:
    assert build_chat_turn(thinking, HELLO, reasoning=R1, thinking_budget=3).processor is not None
    with pytest.raises(NeedsReasoningModel):
        build_chat_turn(thinking, HELLO, thinking_budget=3)
    with pytest.raises(ChatTurnError, match="thinking_token_budget must be an integer") as refused:
        build_chat_turn(thinking, HELLO, reasoning=R1, thinking_budget=-1)
    assert refused.value.part == "thinking_budget"


def test_the_reader_splits_a_whole_and_a_streamed_answer_alike(thinking) -> None:
    reader = build_chat_turn(thinking, HELLO, tools=[WEATHER], reasoning=R1, tool_parser=HERMES).reader
    answer = "I think so.</think>\n\nIt is sunny.\n" + CALL
    reasoning, content, [call] = reader.split(answer)
    stream = reader.stream()
    pieces = [stream.push(answer[i:i + 7]) for i in range(0, len(answer), 7)] + [stream.finish()]
    assert "".join(p.reasoning for p in pieces) == reasoning == "I think so."
    assert "".join(p.content for p in pieces).strip() == content.strip() == "It is sunny."
    assert [c.name for c in pieces[-1].tool_calls] == [call.name]
