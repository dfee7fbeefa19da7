"""`LLM.chat` renders through the shared chat renderer: tools and tool history follow its one policy."""

from __future__ import annotations

from paged_backend import SamplingParams
from paged_backend.entrypoints.chat import render_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def test_chat_with_tools_shows_them_to_a_model_whose_template_ignores_them(default_llm) -> None:
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    [out] = default_llm.chat(conversation, ONE_TOKEN, use_tqdm=False, tools=[WEATHER])
    prompt = default_llm.tokenizer.decode(out.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert out.prompt_token_ids == render_chat(default_llm.tokenizer, conversation, [WEATHER])


def test_chat_without_tools_is_the_template_alone(default_llm) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    [out] = default_llm.chat(conversation, ONE_TOKEN, use_tqdm=False)
    plain = default_llm.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
                                                      return_dict=False)
    assert out.prompt_token_ids == list(plain)


def test_chat_renders_a_tool_history(default_llm) -> None:
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    [out] = default_llm.chat(history, ONE_TOKEN, use_tqdm=False, tools=[WEATHER])
    prompt = default_llm.tokenizer.decode(out.prompt_token_ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt
