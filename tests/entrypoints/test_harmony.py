"""gpt-oss's harmony format read by both parsers together, as every chat-shaped route reads an answer
(`AnswerReader`): analysis to the reasoning, final to the content, calls to functions as tool calls,
streamed in any chunking and at once alike, and no markup in the content; the thinking budget and
the reasoning-token count on harmony's markers; a forced call's grammar after the thinking; the
markers kept through decoding; detection from a gpt-oss-like template."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.chunks import chunkings
from helpers.scripted import HARMONY_MARKERS, harmony_tokenizer
from paged_backend.entrypoints.answer_reader import AnswerReader
from paged_backend.entrypoints.structured import forced_tool_spec
from paged_backend.entrypoints.tool_calls import (
    detect_tool_parser,
    get_tool_parser,
    keeps_special_tokens,
)
from xgrammar.testing import _is_grammar_accept_string

from paged_backend.entrypoints.harmony.messages import read_messages
from paged_backend.entrypoints.reasoning import (
    after_thinking,
    budget_processor,
    detect_reasoning_parser,
    get_reasoning_parser,
    reasoning_tokens,
)
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

HARMONY, CALLS = get_reasoning_parser("harmony"), get_tool_parser("harmony")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER]
THINK = "<|channel|>analysis<|message|>The user asks for the weather. I should call get_weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
REASONING = "The user asks for the weather. I should call get_weather."
PARIS = [("get_weather", {"city": "Paris"})]
# A gpt-oss-like template: harmony's headers, a developer message with the tools, `<|start|>assistant` to answer.
TEMPLATE = ("{% if tools %}{{ '<|start|>developer<|message|># Tools\n' + (tools | tojson) + '<|end|>' }}{% endif %}"
            "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + (m['content'] or '') + '<|end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
            "{# a past thinking: <|channel|>analysis<|message|> #}")

# (answer, opened, reasoning, content, calls)
CASES = [
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.", False, REASONING, "It is sunny.", []),
    ("<|channel|>final<|message|>It is sunny.<|return|>", False, None, "It is sunny.", []),
    (THINK + CALL, False, REASONING, None, PARIS),
    # a preamble to the user on the commentary channel before the call, and the stop token dropped
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>" + CALL[:-len("<|call|>")],
     False, REASONING, "Checking the weather.", PARIS),
    # the recipient before the channel, as gpt-oss's template renders past calls
    ('<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
     '<|message|>{"city": "Paris"}<|call|>', False, "Hmm.", None, PARIS),
    # the prompt opened the thinking
    ("Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Yes.", True, "Hmm.", "Yes.", []),
    # cut short by max_tokens inside a header: the thinking so far, no markup
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>fi", False, "Hmm.", None, []),
    # a model that writes no harmony at all: plain content
    ("Just text.", False, None, "Just text.", []),
]


def plan(opened: bool) -> AnswerReader:
    return AnswerReader(HARMONY, opened, CALLS, TOOLS)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content", "calls"), CASES)
def test_analysis_final_and_calls_split_streamed_or_not(text, opened, reasoning, content, calls) -> None:
    got_reasoning, got_content, got_calls = plan(opened).split(text)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for pieces in chunkings(text, longest=12):
        stream = plan(opened).stream()
        outs = [stream.push(p) for p in pieces] + [stream.finish()]
        assert "".join(o.reasoning for o in outs) == (reasoning or "")
        streamed_content = "".join(o.content for o in outs)
        assert streamed_content.strip() == (content or "")
        assert not any(marker in streamed_content for marker in HARMONY_MARKERS)
        assert [(c.name, json.loads(c.arguments)) for c in outs[-1].tool_calls] == calls


@pytest.mark.parametrize("broken", [
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ',
    '<|channel|>commentary to=python<|message|>print(1)<|call|>',
])
def test_a_malformed_call_comes_back_as_text(broken: str) -> None:
    reasoning, content, calls = plan(False).split(THINK + "<|start|>assistant" + broken)
    assert reasoning == REASONING and calls == [] and content.endswith(broken)


def test_messages_keep_their_place_in_the_text() -> None:
    text = THINK + CALL
    messages, settled = read_messages(text)
    assert settled == len(text) and [m.header.channel for m in messages] == ["analysis", "commentary"]
    assert [text[m.start:m.stop] for m in messages] == [THINK, CALL]
    assert messages[1].header.recipient == "functions.get_weather" and messages[1].header.content_type == "json"
    _, settled = read_messages(THINK + "<|start|>assistant<|chan", complete=False)
    assert settled == len(THINK)  # a header still being written is held back


def test_the_prompt_opens_the_thinking_only_inside_an_analysis_message() -> None:
    assert HARMONY.opens_thinking("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>")
    assert not HARMONY.opens_thinking("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert not HARMONY.opens_thinking("<|channel|>analysis<|message|>a<|end|><|start|>assistant")


def test_detected_from_a_gpt_oss_template() -> None:
    assert detect_reasoning_parser(TEMPLATE) is HARMONY and detect_tool_parser(TEMPLATE) is CALLS
    assert detect_reasoning_parser(TEMPLATE + "<think></think>") is None  # two formats named: not unambiguous


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer([THINK + CALL, "It is sunny in Paris. The weather is nice."] * 3, TEMPLATE)


def test_the_markers_are_special_and_kept(tokenizer) -> None:
    assert keeps_special_tokens(tokenizer, HARMONY.markers) and keeps_special_tokens(tokenizer, CALLS.markers)
    ids = tokenizer.encode(THINK + CALL, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == THINK + CALL
    assert "<|channel|>" not in tokenizer.decode(ids, skip_special_tokens=True)  # why the markers must be kept


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def forced(processor, output_ids: list[int], vocab: int) -> int | None:
    row = processor(output_ids, torch.zeros(vocab))
    return int(row.argmax()) if torch.isinf(row).any() else None


def test_the_budget_closes_the_analysis_message(tokenizer) -> None:
    vocab, end = len(tokenizer), ids(tokenizer, "<|end|><|start|>assistant")
    closing = budget_processor(tokenizer, HARMONY, 2, opened=False)
    thinking = ids(tokenizer, "<|channel|>analysis<|message|>") + ids(tokenizer, "The user")[:2]
    assert forced(closing, thinking[:-1], vocab) is None
    written = list(thinking)
    for token in end:  # the end of the message and the next one's start, token by token
        assert forced(closing, written, vocab) == token
        written.append(token)
    assert forced(closing, written, vocab) is None  # the model picks the next channel itself
    # the analysis message through its <|end|>; `<|start|>assistant` opens the final message
    assert reasoning_tokens(tokenizer, HARMONY, written + ids(tokenizer, "<|channel|>final<|message|>Hi"),
                            opened=False) == len(written) - len(ids(tokenizer, "<|start|>assistant"))


def test_reasoning_tokens_count_every_analysis_message(tokenizer) -> None:
    again = "<|start|>assistant<|channel|>analysis<|message|>Paris then.<|end|>"
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    answer = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    text = THINK + preamble + again + answer
    thinking = len(ids(tokenizer, THINK)) + len(ids(tokenizer, again))
    assert reasoning_tokens(tokenizer, HARMONY, ids(tokenizer, text), opened=False) == thinking
    # a prompt that opened the analysis message: its first tokens are thinking without a header
    opened = THINK.removeprefix("<|channel|>analysis<|message|>") + answer
    assert reasoning_tokens(tokenizer, HARMONY, ids(tokenizer, opened), opened=True) == \
        len(ids(tokenizer, THINK)) - len(ids(tokenizer, "<|channel|>analysis<|message|>"))
    assert reasoning_tokens(tokenizer, HARMONY, ids(tokenizer, answer), opened=False) == 0
    assert reasoning_tokens(tokenizer, HARMONY, ids(tokenizer, THINK + CALL), opened=False) == len(ids(tokenizer, THINK))


def test_a_json_answer_after_the_thinking_opens_the_final_channel() -> None:
    spec = after_thinking(StructuredOutputsParams(json={"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}),
                          HARMONY, opened=False)
    answer = '<|channel|>final<|message|>{"city": "Paris"}'
    assert _is_grammar_accept_string(spec.grammar, THINK + "<|start|>assistant" + answer)
    assert _is_grammar_accept_string(spec.grammar, answer)  # no thinking at all
    assert not _is_grammar_accept_string(spec.grammar, THINK + '<|start|>assistant{"city": "Paris"}')
    assert plan(False).split(THINK + "<|start|>assistant" + answer)[:2] == (REASONING, '{"city": "Paris"}')


@pytest.mark.parametrize("forced_call", [False, True])
def test_the_chat_turn_says_whether_the_grammar_is_a_forced_call(monkeypatch, forced_call: bool) -> None:
    from paged_backend.entrypoints import chat_turn

    seen = {}
    monkeypatch.setattr(chat_turn, "after_thinking", lambda *args: seen.setdefault("args", args))
    chat_turn.hold_after_thinking("spec", HARMONY, False, forced_call)
    assert seen["args"] == ("spec", HARMONY, False, forced_call)


def test_a_forced_call_grammar_follows_the_thinking() -> None:
    grammar = after_thinking(forced_tool_spec(TOOLS, "required", True, CALLS), HARMONY, opened=False,
                             forced_call=True).grammar
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert _is_grammar_accept_string(grammar, call)
    assert _is_grammar_accept_string(grammar, THINK + "<|start|>assistant" + call)
    assert not _is_grammar_accept_string(grammar, THINK + "<|start|>assistant<|channel|>final<|message|>Hi")
    assert not _is_grammar_accept_string(grammar, call.replace("get_weather", "get_time"))
    _, content, [parsed] = AnswerReader(HARMONY, False, CALLS, TOOLS, forced=True).split(THINK + "<|start|>assistant"
                                                                                      + call)
    assert content is None and (parsed.name, json.loads(parsed.arguments)) == PARIS[0]
