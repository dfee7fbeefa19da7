"""LLM(reasoning_parser=...): chat splits each completion's thinking into `reasoning`, and
thinking_token_budget closes the thinking through the engine's per-request logits processor."""

from __future__ import annotations

import pytest
from helpers.scripted import force, harmony_tokenizer, marker_tokenizer, tiny_model

from paged_backend import LLM, SamplingParams
from paged_backend.entrypoints import chat_turn
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

# DeepSeek-R1's way: the generation prompt opens the thinking, and past answers lose theirs.
R1_LIKE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'].split('</think>')[-1] + "
           "'<|im_end|>\n' }}"
           "{% endfor %}{{ '<|im_start|>assistant\n<think>\n' }}")
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer():
    return marker_tokenizer(["Say hello. I think so. Hello there."] * 3, R1_LIKE)


def test_chat_splits_the_thinking_and_the_budget_closes_it(tokenizer) -> None:
    llm = LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=64, reasoning_parser="deepseek_r1")
    end = tokenizer.convert_tokens_to_ids("</think>")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [output] = llm.chat(HELLO, params, use_tqdm=False, thinking_token_budget=3)
    completion = output.outputs[0]
    assert completion.token_ids[3] == end  # three thinking tokens, then the forced end marker
    reasoning, content = llm.reasoning.split(tokenizer.decode(completion.token_ids), opened=True)
    assert (completion.reasoning, completion.text) == (reasoning, content)
    assert "</think>" not in completion.text and "<think>" not in completion.text
    [none] = llm.chat(HELLO, params, use_tqdm=False, thinking_token_budget=0)
    assert none.outputs[0].token_ids[0] == end and none.outputs[0].reasoning == ""


def test_structured_outputs_hold_the_answer_after_the_thinking(tokenizer) -> None:
    # The prompt opened the thinking: a grammar from the first token would write the choice inside it
    # (reasoning "yes", answer ""); held after the end marker, the thinking runs first and the answer obeys.
    llm = LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=64, reasoning_parser="deepseek_r1")
    end = tokenizer.convert_tokens_to_ids("</think>")
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    [output] = llm.chat(HELLO, params, use_tqdm=False, thinking_token_budget=3)
    completion = output.outputs[0]
    assert completion.token_ids[3] == end and completion.finish_reason == "stop"
    assert completion.text.strip() in ("yes", "no") and completion.reasoning == tokenizer.decode(completion.token_ids[:3])
    assert params.structured_outputs.choice == ["yes", "no"]  # the caller's params are left as they were


def test_without_a_parser_chat_is_unchanged_and_bad_options_are_named(tokenizer) -> None:
    llm = LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=64)
    [output] = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert output.outputs[0].reasoning is None
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        llm.chat(HELLO, SamplingParams(max_tokens=2), use_tqdm=False, thinking_token_budget=2)
    with pytest.raises(ValueError, match="reasoning_parser='nope'"):
        LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=64, reasoning_parser="nope")
    assert LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=64, reasoning_parser="auto").reasoning.name == "qwen3"


# gpt-oss's way: harmony's markers are special tokens, which decoding drops unless told to keep them.
HARMONY_OPENED = ("{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
                  "{% endfor %}{{ '<|start|>assistant<|channel|>analysis<|message|>' }}")


def test_chat_splits_at_markers_that_are_special_tokens(monkeypatch) -> None:
    tokenizer = harmony_tokenizer(["Say hello. I think so. Hello there. assistant analysis final"] * 3, HARMONY_OPENED)
    llm = LLM(tiny_model(tokenizer), tokenizer, num_kv_blocks=64, reasoning_parser="auto")
    assert llm.reasoning.name == "harmony"
    closing = tokenizer.encode("<|end|><|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)
    thought = tokenizer.encode(" I think so.", add_special_tokens=False)
    answer = tokenizer.encode(" Hello there.", add_special_tokens=False)
    script = thought + closing + answer
    # A random model would never write the turn: a processor in place of chat's own (a thinking budget's) forces it.
    monkeypatch.setattr(chat_turn, "budget_processor", lambda *_: lambda ids, row: force(row, script[len(ids)]))
    [output] = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=len(script), ignore_eos=True), use_tqdm=False,
                        thinking_token_budget=len(script))
    completion = output.outputs[0]
    assert completion.token_ids == script
    assert (completion.reasoning, completion.text) == (" I think so.", " Hello there.")
