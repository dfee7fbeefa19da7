"""The shared chat renderer and its one tool policy (paged_backend/entrypoints/chat.py), on small templates."""

from __future__ import annotations

import pytest
import transformers as tf
from tokenizers import Tokenizer, models

from paged_backend.entrypoints.chat import (
    HERMES_TOOL_PROMPT,
    ChatInputError,
    UnsupportedContent,
    render_chat,
    renders_tools,
)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A template that renders tools, past calls (with their ids) and results itself.
NATIVE = ("{% if tools %}[TOOLS]{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
          "[/TOOLS]{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
          "{% for c in m.get('tool_calls', []) %}[CALL {{ c['id'] }} {{ c['function']['name'] }} "
          "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
          "{% if m.get('tool_call_id') %}[FOR {{ m['tool_call_id'] }}]{% endif %}{% endfor %}")
# Mentions tools in a comment, renders none of them.
MENTIONS_ONLY = "{# tools are not supported #}" + CHATML
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def tokenizer(template: str) -> tf.PreTrainedTokenizerFast:
    return tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                      chat_template=template)


def test_a_template_without_tools_gets_the_hermes_format() -> None:
    text = render_chat(tokenizer(CHATML), HISTORY, [WEATHER], tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and system.endswith("</tool_call>")
    assert HERMES_TOOL_PROMPT.split("{tools}")[0] in system and '"name": "get_weather"' in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text


def test_without_tools_no_tool_prompt_is_added_but_history_stays_hermes_text() -> None:
    text = render_chat(tokenizer(CHATML), HISTORY, None, tokenize=False)
    assert "<tools>" not in text and "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "<tool_call>" in text and "<tool_response>\n18 C" in text


def test_a_template_that_renders_tools_gets_them_and_the_history_as_they_are() -> None:
    text = render_chat(tokenizer(NATIVE), HISTORY, [WEATHER], tokenize=False)
    assert text == ('[TOOLS]get_weather[/TOOLS]<system>Be brief.<user>Weather in Paris?'
                    '<assistant>[CALL call_1 get_weather {"city": "Paris"}]<tool>18 C[FOR call_1]')
    assert HERMES_TOOL_PROMPT[:40] not in text


def test_the_policy_follows_what_the_template_renders_not_what_it_mentions() -> None:
    assert not renders_tools(tokenizer(MENTIONS_ONLY)) and renders_tools(tokenizer(NATIVE))
    text = render_chat(tokenizer(MENTIONS_ONLY), HISTORY[1:2], [WEATHER], tokenize=False)
    assert text.startswith("<|im_start|>system\n" + HERMES_TOOL_PROMPT[:40])


def test_a_chat_template_argument_is_the_template_judged_and_used() -> None:
    text = render_chat(tokenizer(CHATML), HISTORY[1:2], [WEATHER], chat_template=NATIVE, tokenize=False)
    assert text == "[TOOLS]get_weather[/TOOLS]<user>Weather in Paris?"


def test_token_ids_are_the_rendered_text_tokenized() -> None:
    tok = tokenizer(CHATML)
    ids = render_chat(tok, HISTORY[1:2])
    assert ids == tok(render_chat(tok, HISTORY[1:2], tokenize=False), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(("messages", "error", "field"), [
    ([{"role": "robot", "content": "hi"}], ChatInputError, "messages.0.role"),
    ([{"role": "user", "content": 7}], ChatInputError, "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], UnsupportedContent,
     "messages[0].content part of type 'image_url'"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], ChatInputError,
     "messages"),
])
def test_bad_messages_are_refused_naming_the_field(messages, error, field) -> None:
    with pytest.raises(error) as caught:
        render_chat(tokenizer(CHATML), messages)
    assert caught.value.field == field


def test_no_template_is_refused() -> None:
    with pytest.raises(ChatInputError, match="no chat template"):
        render_chat(tokenizer(""), HISTORY)
