"""Each tool-call format parses its family's own documented examples, streamed (in any chunking) and
not, with the same result; malformed calls are reported, never raised; forced-call grammars accept the
format they are meant to hold; the template says which format a model writes."""

from __future__ import annotations

import json

import pytest
from helpers.chunks import chunkings
from paged_backend.entrypoints.tool_calls.answer_calls import (
    ToolCallStreamer,
    parse_tool_calls,
)
from paged_backend.entrypoints.structured import forced_tool_spec
from paged_backend.entrypoints.tool_calls import (
    HERMES,
    detect_tool_parser,
    get_tool_parser,
    resolve_tool_parser,
)
from xgrammar.testing import _is_grammar_accept_string

TEMPERATURE = {"type": "function", "function": {
    "name": "get_current_temperature", "description": "Get current temperature at a location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["location"]}}}
TOOLS = [TEMPERATURE]
SF = {"location": "San Francisco, CA, USA"}
SF_UNIT = {"location": "San Francisco, CA, USA", "unit": "celsius"}

# (format, answer as the family's documentation shows it, content, [(name, arguments)])
EXAMPLES = [
    # Qwen2.5 / Hermes 2 Pro function-calling docs: one block per call, text around them allowed.
    ("hermes", ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
               '\n</tool_call>'), None, [("get_current_temperature", SF)]),
    ("hermes", ('Let me check.\n<tool_call>\n{"name": "get_current_temperature", "arguments": '
               '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>'),
     "Let me check.", [("get_current_temperature", SF_UNIT), ("get_current_temperature", SF)]),
    # Llama 3.1 prompt format (custom tools, JSON): the whole answer is the call, "parameters" not "arguments".
    ("llama3_json", '{"name": "get_current_temperature", "parameters": {"location": "San Francisco, CA, USA"}}',
     None, [("get_current_temperature", SF)]),
    ("llama3_json", ('<|python_tag|>{"name": "get_current_temperature", "parameters": {"location": '
                    '"San Francisco, CA, USA", "unit": "celsius"}}; {"name": "get_current_temperature", '
                    '"parameters": {"location": "San Francisco, CA, USA"}}'),
     None, [("get_current_temperature", SF_UNIT), ("get_current_temperature", SF)]),
    # Mistral 7B Instruct v0.3's model card: an array after [TOOL_CALLS].
    ("mistral", ('[TOOL_CALLS] [{"name": "get_current_temperature", "arguments": {"location": '
                '"San Francisco, CA, USA", "unit": "celsius"}}]'), None, [("get_current_temperature", SF_UNIT)]),
    # Mistral's tokenizer v11 form (Mistral Small 3.2, Magistral): name[ARGS]arguments per call.
    ("mistral", ('Checking.[TOOL_CALLS]get_current_temperature[ARGS]{"location": "San Francisco, CA, USA"}'
                '[TOOL_CALLS]get_current_temperature[ARGS]{"location": "San Francisco, CA, USA", "unit": "celsius"}'),
     "Checking.", [("get_current_temperature", SF), ("get_current_temperature", SF_UNIT)]),
    # Qwen3-Coder's chat template: XML parameters, typed by the tool's schema.
    ("qwen3_coder", ("<tool_call>\n<function=get_current_temperature>\n<parameter=location>\nSan Francisco, CA, USA\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
     None, [("get_current_temperature", SF | {"days": 3})]),
    ("qwen3_coder", ("Sure.\n<tool_call>\n<function=get_current_temperature>\n<parameter=location>\nSan Francisco, CA, "
                    "USA\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_current_temperature>\n"
                    "<parameter=location>\nSan Francisco, CA, USA\n</parameter>\n<parameter=unit>\ncelsius\n"
                    "</parameter>\n</function>\n</tool_call>"),
     "Sure.", [("get_current_temperature", SF), ("get_current_temperature", SF_UNIT)]),
    # gpt-oss's harmony format (OpenAI's harmony guide): a commentary message to functions.NAME, JSON body,
    # ended by <|call|>; the recipient may stand before the channel, and the stop token may be dropped.
    ("harmony", ('<|channel|>commentary to=functions.get_current_temperature <|constrain|>json<|message|>'
                '{"location": "San Francisco, CA, USA"}<|call|>'), None, [("get_current_temperature", SF)]),
    ("harmony", ('<|start|>assistant to=functions.get_current_temperature<|channel|>commentary json<|message|>'
                '{"location": "San Francisco, CA, USA", "unit": "celsius"}'), None,
     [("get_current_temperature", SF_UNIT)]),
]


def streamed(parser_name: str, pieces: list[str]) -> tuple[str, list, dict[int, tuple[str, str]]]:
    """(content sent, calls of the final parse, {index: (name, argument text)} from the streamed deltas)."""
    streamer = ToolCallStreamer(get_tool_parser(parser_name), TOOLS)
    content, deltas = "", {}
    for piece in [*pieces, None]:
        if piece is not None:
            content += streamer.push(piece)
        for delta in streamer.stream.deltas():
            name, text = deltas.get(delta.index, (delta.name, ""))
            deltas[delta.index] = (name, text + delta.arguments)
    rest, calls = streamer.finish()
    return content + rest, calls, deltas


@pytest.mark.parametrize(("parser_name", "text", "content", "expected"), EXAMPLES)
def test_documented_examples_parse_streamed_or_not(parser_name: str, text: str, content, expected) -> None:
    got_content, calls = parse_tool_calls(text, get_tool_parser(parser_name), TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    for pieces in chunkings(text):
        sent, stream_calls, deltas = streamed(parser_name, pieces)
        assert sent.strip() == (content or "")
        assert [(c.name, json.loads(c.arguments)) for c in stream_calls] == expected
        # Every call streamed name first and its argument pieces add up to its arguments.
        assert [(name, json.loads(text)) for name, text in (deltas[i] for i in sorted(deltas))] == expected


@pytest.mark.parametrize(("parser_name", "text"), [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": }\n</tool_call>'),
    ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),
    ("llama3_json", '{"name": "get_current_temperature", "parameters": {"location": "SF"}} and then some text'),
    ("llama3_json", '{"location": "SF"}'),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_current_temperature\", \"arguments\": {\"location\""),
    ("mistral", "[TOOL_CALLS]get_current_temperature{\"location\": \"SF\"}"),
    ("qwen3_coder", "<tool_call>\n<parameter=location>\nSF\n</parameter>\n</tool_call>"),
    ("harmony", '<|channel|>commentary to=functions.get_current_temperature <|constrain|>json<|message|>{"location": '),
    ("harmony", '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "SF"}<|call|>'),
    ("harmony", '<|channel|>commentary to=functions.get_current_temperature<|message|>["SF"]<|call|>'),
])
def test_a_malformed_call_is_left_as_text(parser_name: str, text: str) -> None:
    parser = get_tool_parser(parser_name)
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])
    parsed = parser.parse(text, TOOLS)
    assert parsed.calls and not parsed.all_valid and all(c.error for c in parsed.calls if not c.valid)
    assert streamed(parser_name, list(text))[:2] == (text, [])


def test_content_streams_until_a_call_may_begin() -> None:
    streamer = ToolCallStreamer(get_tool_parser("mistral"))
    assert streamer.push("Hello [TOOL") == "Hello " and streamer.push("box]") == "[TOOLbox]"
    llama = ToolCallStreamer(get_tool_parser("llama3_json"))
    assert llama.push("  ") == "" and llama.push("<|pyth") == "" and llama.push("on is fun") == "  <|python is fun"
    assert ToolCallStreamer(get_tool_parser("llama3_json")).push(" {") == ""


# Each format's forced-call text, as the grammar of tool_choice="required" must accept it (compact JSON).
FORCED = {
    "hermes": '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "SF", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_current_temperature", "parameters": {"location": "SF", "days": 2}}',
    "mistral": '[{"name": "get_current_temperature", "arguments": {"location": "SF", "days": 2}}]',
    "qwen3_coder": "<tool_call>\n<function=get_current_temperature>\n<parameter=location>SF</parameter>\n"
                   "<parameter=days>2</parameter>\n</function>\n</tool_call>",
    "harmony": ('<|channel|>commentary to=functions.get_current_temperature <|constrain|>json<|message|>'
                '{"location": "SF", "days": 2}'),
}


@pytest.mark.parametrize("parser_name", sorted(FORCED))
def test_forced_call_grammars_hold_each_format(parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    grammar = forced_tool_spec(TOOLS, "required", True, parser).grammar
    text = FORCED[parser_name]
    assert _is_grammar_accept_string(grammar, text)
    assert not _is_grammar_accept_string(grammar, text.replace("get_current_temperature", "other_tool"))
    assert not _is_grammar_accept_string(grammar, text.replace("2", '"two"').replace(">2<", ">two<"))
    _, [call] = parse_tool_calls(text, parser, TOOLS, parser.forced_prefix)
    assert call.name == "get_current_temperature" and json.loads(call.arguments)["location"] == "SF"


@pytest.mark.parametrize(("template", "expected"), [
    ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
    ("{{ '<tool_call>\n<function=' }}", "qwen3_coder"),
    ("{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[TOOL_CALLS]' }}", "mistral"),
    ("{{ '<|start_header_id|>ipython<|end_header_id|>' }}{{ '<|python_tag|>' }}", "llama3_json"),
    ("{{ '<|start|>assistant<|channel|>' + m.channel + '<|message|>' }}", "harmony"),
    ("{{ messages }}", None),
    ("{{ '<tool_call>[TOOL_CALLS]' }}", None),  # two formats named: not unambiguous
])
def test_the_template_names_the_format(template: str, expected: str | None) -> None:
    found = detect_tool_parser(template)
    assert (found.name if found else None) == expected


def test_unknown_names_and_the_default() -> None:
    with pytest.raises(ValueError, match="tool_call_parser='nope'.*known: \\['harmony', 'hermes', 'llama3_json'"):
        get_tool_parser("nope")

    class Plain:
        chat_template = "{{ messages }}"

    assert resolve_tool_parser("auto", Plain()) is HERMES and resolve_tool_parser(None, None) is HERMES
