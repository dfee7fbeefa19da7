"""The OpenAI-compatible server, driven by the real `openai` client over HTTP on 127.0.0.1.

Two servers, one per model, each started once for this module in a thread on a free port:
- `real`: the default model (SmolLM2-135M-Instruct), for real text, stop strings, n, logprobs.
- `tiny`: a two-layer Llama with a byte-level BPE tokenizer, both built here, trained for a few
  seconds to answer three chats exactly (two of them with Hermes `<tool_call>` blocks), so tool
  calling is checked end to end. It also carries an API key, for the auth and error tests.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers as tf
from helpers.server import (
    KEY,
    Served,
    build_chat_tokenizer,
    parse_metrics,
    serve,
    tiny_llama,
    wait_all_blocks_free,
)
from helpers.tolerances import approx
from paged_backend.integrations.server.chat_template import add_tool_prompt, render_chat
from paged_backend.entrypoints.tool_calls.answer_calls import (
    ToolCallStreamer,
    parse_tool_calls,
)

from paged_backend import LLM

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
ROME_OSLO = [{"role": "user", "content": "Weather in Rome and Oslo?"}]
HELLO = [{"role": "user", "content": "Say hello."}]


def call_text(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


# What the tiny model is trained to answer, given the WEATHER tool.
SCRIPT = [(PARIS, call_text("Paris")), (ROME_OSLO, call_text("Rome") + "\n" + call_text("Oslo")),
          (HELLO, "Hello there, friend!")]


# ------------------------------------------------------------------ shared helpers (also used by the load test)


def tool_tokenizer() -> tf.PreTrainedTokenizerFast:
    tool_prompt = add_tool_prompt([], [WEATHER])[0]["content"]
    corpus = [tool_prompt] * 5 + [answer for _, answer in SCRIPT] * 5 + [m[0]["content"] for m, _ in SCRIPT]
    return build_chat_tokenizer(corpus)


def train_to_script(model, tokenizer, max_steps: int = 400) -> None:
    """Fit the model until greedy decoding reproduces every scripted answer (teacher-forced argmax all right)."""
    rows = [(render_chat(tokenizer, m, [WEATHER]), tokenizer.encode(a) + [tokenizer.eos_token_id]) for m, a in SCRIPT]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, a) in enumerate(rows):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(max_steps):
        out = model(input_ids=ids, labels=labels)
        optimiser.zero_grad()
        out.loss.backward()
        optimiser.step()
        predicted, target = out.logits[:, :-1].argmax(-1), labels[:, 1:]
        if out.loss.item() < 0.02 and bool((predicted[target != -100] == target[target != -100]).all()):
            break
    model.eval()


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def real() -> Iterator[Served]:
    # The exact fp32 weights, as the suite's other default-model fixture (conftest.default_llm): these tests'
    # answers (seeded samples, lengths) were chosen on them; int4, the default there otherwise, has its tests.
    with serve(LLM(None, dtype=torch.float32, num_kv_blocks=256), "smollm2") as served:
        yield served


@pytest.fixture(scope="module")
def tiny() -> Iterator[Served]:
    tokenizer = tool_tokenizer()
    model = tiny_llama(tokenizer)
    train_to_script(model, tokenizer)
    with serve(LLM(model, tokenizer, num_kv_blocks=64), "tiny", api_key=KEY) as served:
        yield served


def greedy(**kwargs) -> dict:
    return dict(temperature=0, **kwargs)


# ------------------------------------------------------------------ real text (default model)

@pytest.mark.slow  # the default model behind the server: the slow tier
def test_models_lists_the_served_name(real: Served) -> None:
    assert [m.id for m in real.client().models.list().data] == ["smollm2"]


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_chat_answers_with_real_text_and_usage(real: Served) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = real.client().chat.completions.create(model="smollm2", messages=messages, **greedy(max_tokens=12))
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(render_chat(real.tokenizer, messages, None))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_chat_stream_equals_the_plain_answer(real: Served) -> None:
    client = real.client()
    args = dict(model="smollm2", messages=[{"role": "user", "content": "Name a colour."}], **greedy(max_tokens=10))
    plain = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert [c.usage for c in chunks if c.usage] == [plain.usage] and not chunks[-1].choices


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_completion_prompt_forms_and_echo(real: Served) -> None:
    client = real.client()
    prompt = "The capital of France is"
    by_text = client.completions.create(model="smollm2", prompt=prompt, **greedy(max_tokens=4))
    assert "Paris" in by_text.choices[0].text
    ids = real.tokenizer(prompt)["input_ids"]
    by_ids = client.completions.create(model="smollm2", prompt=ids, **greedy(max_tokens=4))
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model="smollm2", prompt=prompt, echo=True, **greedy(max_tokens=4))
    assert echoed.choices[0].text == prompt + by_text.choices[0].text
    both = client.completions.create(model="smollm2", prompt=["1, 2, 3,", prompt], **greedy(max_tokens=4))
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[1].text == by_text.choices[0].text and both.choices[0].text != by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + len(real.tokenizer("1, 2, 3,")["input_ids"])


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_stop_string_cuts_the_text(real: Served) -> None:
    client = real.client()
    prompt = "Count: one, two, three, four, five,"
    free = client.completions.create(model="smollm2", prompt=prompt, **greedy(max_tokens=8)).choices[0]
    assert "," in free.text
    stopped = client.completions.create(model="smollm2", prompt=prompt, stop=[","], **greedy(max_tokens=8)).choices[0]
    assert stopped.text == free.text.split(",")[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == ","


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_echo_with_logprobs_scores_the_prompt(real: Served) -> None:
    """echo + logprobs (how evaluation harnesses score text): every prompt token after the first gets
    the model's own log probability, then the generated tokens follow."""
    client = real.client()
    prompt = "The capital of France is"
    reply = client.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=2, **greedy(max_tokens=2))
    lp, text = reply.choices[0].logprobs, reply.choices[0].text
    ids = real.tokenizer(prompt)["input_ids"]
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens) == text and text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    with torch.no_grad():
        expected = torch.log_softmax(real.aengine.engine.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert lp.token_logprobs[1:len(ids)] == approx([expected[t - 1, ids[t]].item() for t in range(1, len(ids))])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=2, stream=True,
                                            **greedy(max_tokens=2)))
    first = chunks[0].choices[0].logprobs
    assert first.tokens[:len(ids)] == lp.tokens[:len(ids)] and first.token_logprobs[0] is None


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_logit_bias_forces_and_bans_tokens(real: Served) -> None:
    client = real.client()
    args = {"model": "smollm2", "prompt": "The capital of France is", **greedy(max_tokens=4)}
    plain = client.completions.create(logprobs=0, **args).choices[0]
    first = real.tokenizer(plain.logprobs.tokens[0], add_special_tokens=False)["input_ids"][0]
    banned = client.completions.create(logit_bias={str(first): -100}, **args).choices[0].text
    assert banned != plain.text and not banned.startswith(plain.logprobs.tokens[0])
    forced = real.tokenizer(" Rome", add_special_tokens=False)["input_ids"][0]
    text = client.completions.create(logit_bias={str(forced): 100}, **args).choices[0].text
    assert text == real.tokenizer.decode([forced] * 4)
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          logit_bias={str(forced): 100}, **greedy(max_tokens=3))
    assert chat.choices[0].message.content == real.tokenizer.decode([forced] * 3)


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_n_choices_use_derived_seeds(real: Served) -> None:
    client = real.client()
    args = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    many = client.completions.create(n=3, seed=7, **args)
    texts = [c.text for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert many.usage.completion_tokens == 24
    # Choice i is exactly the single request seeded seed + i.
    assert client.completions.create(n=1, seed=9, **args).choices[0].text == texts[2]
    streamed = [""] * 3
    for chunk in client.completions.create(n=3, seed=7, stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_best_of_returns_the_choice_with_the_best_logprob_per_token(real: Served) -> None:
    client = real.client()
    args = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 8}
    candidates = client.completions.create(n=3, logprobs=0, **args).choices
    scores = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
    assert scores.index(max(scores)) != 0  # so returning the first sample would fail
    best = client.completions.create(n=1, best_of=3, **args)
    assert [c.text for c in best.choices] == [candidates[scores.index(max(scores))].text]
    for bad in ({"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(**args | bad)
        assert error.value.body["param"] == "best_of"


PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}, "employed": {"type": "boolean"},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "employed", "languages"]}


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_json_schema_answers_parse_and_follow_the_schema(real: Served) -> None:
    client = real.client()
    args = {"model": "smollm2", "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "Alice is 30, works as a nurse and speaks French."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}}
    reply = client.chat.completions.create(**args)
    person = json.loads(reply.choices[0].message.content)
    jsonschema.validate(person, PERSON_SCHEMA)
    assert list(person) == ["name", "age", "employed", "languages"] and reply.choices[0].finish_reason == "stop"
    # Streamed token by token, the chunks add up to the same answer.
    chunks = list(client.chat.completions.create(stream=True, **args))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 5 and "".join(pieces) == reply.choices[0].message.content
    # max_tokens too small for the answer: its first tokens, and a finish reason that says so.
    short = client.chat.completions.create(**{**args, "max_tokens": 3})
    assert short.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith(short.choices[0].message.content)
    # Without a schema (json_object) the answer is one JSON object.
    free = client.chat.completions.create(**{**args, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(free.choices[0].message.content), dict)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.slow  # the default model behind the server: the slow tier
def test_langchain_chatopenai_structured_output(real: Served, method: str) -> None:
    """LangChain's own OpenAI chat model, pointed at the server: both structured-output methods parse."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str
        age: int

    chat = langchain_openai.ChatOpenAI(base_url=f"{real.url}/v1", api_key="none", model="smollm2", temperature=0,
                                       max_tokens=40, max_retries=0)
    person = chat.with_structured_output(Person, method=method).invoke("Alice is 30 years old.")
    assert person == Person(name="Alice", age=30)


@pytest.mark.slow  # compiles, or runs a whole suite or fuzzer: the slow tier
def test_structured_answers_with_n_choices_use_derived_seeds(real: Served) -> None:
    client = real.client()
    args = {"model": "smollm2", "max_tokens": 60, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Alice is 30, works as a nurse and speaks French."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}}
    many = client.chat.completions.create(n=3, seed=5, **args)
    answers = [c.message.content for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1, 2] and len(set(answers)) > 1
    for answer in answers:
        jsonschema.validate(json.loads(answer), PERSON_SCHEMA)
    # Choice i is exactly the single request seeded seed + i.
    assert client.chat.completions.create(n=1, seed=7, **args).choices[0].message.content == answers[2]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=3, seed=5, stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == answers
    wait_all_blocks_free(real.aengine)


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_chat_logprobs(real: Served) -> None:
    reply = real.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi!"}], logprobs=True, top_logprobs=3,
        **greedy(max_tokens=5))
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_legacy_generate(real: Served) -> None:
    body = {"prompt": "The capital of France is", "n": 2, "temperature": 0, "max_tokens": 4}
    texts = httpx.post(f"{real.url}/generate", json=body, timeout=60).json()["text"]
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0].startswith(body["prompt"]) and "Paris" in texts[0]
    with httpx.stream("POST", f"{real.url}/generate", json=body | {"stream": True}, timeout=60) as response:
        parts = [json.loads(p) for p in response.read().decode().split("\0") if p]
    assert parts[-1]["text"] == texts
    beams = httpx.post(f"{real.url}/generate", json=body | {"use_beam_search": True}, timeout=60).json()["text"]
    assert len(beams) == 2 and beams[0] != beams[1] and all(t.startswith(body["prompt"]) for t in beams)
    unknown = httpx.post(f"{real.url}/generate", json=body | {"beam_width": 3}, timeout=60)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "beam_width"


@pytest.mark.slow  # the default model behind the server: the slow tier
def test_metrics_count_requests_tokens_and_latency(real: Served) -> None:
    client = real.client()
    client.completions.create(model="smollm2", prompt="Hello", **greedy(max_tokens=3))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="Hello", temperature=-1)
    text = httpx.get(f"{real.url}/metrics").text
    values = parse_metrics(text)
    assert values['paged_backend_requests_total{finished_reason="length"}'] >= 1
    assert values["paged_backend_prompt_tokens_total"] >= 1 and values["paged_backend_generation_tokens_total"] >= 3
    assert values['paged_backend_time_to_first_token_seconds_count{path="/v1/completions"}'] >= 1
    assert values['paged_backend_time_per_output_token_seconds_count{path="/v1/completions"}'] >= 1
    assert values['paged_backend_http_requests_total{path="/v1/completions",status="400"}'] >= 1
    assert values["paged_backend_num_requests_running"] == 0 and values["paged_backend_kv_cache_usage_ratio"] == 0
    assert "paged_backend_num_requests_waiting" in values and "paged_backend_prefix_cache_hit_rate" in values


# ------------------------------------------------------------------ tools (tiny trained model)

def test_tool_call_is_parsed(tiny: Served) -> None:
    reply = tiny.client().chat.completions.create(model="tiny", messages=PARIS, tools=[WEATHER], **greedy())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_parallel_tool_calls_and_their_stream(tiny: Served) -> None:
    client = tiny.client()
    args = dict(model="tiny", messages=ROME_OSLO, tools=[WEATHER], **greedy())
    calls = client.chat.completions.create(**args).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Rome", "Oslo"]
    only_first = client.chat.completions.create(parallel_tool_calls=False, **args).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in only_first] == ["Rome"]
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # no half call leaks as text
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tools_allow_several_calls_unless_parallel_calls_are_off(tiny: Served) -> None:
    args = dict(model="tiny", messages=ROME_OSLO, tools=[WEATHER], tool_choice="required", **greedy())
    both = tiny.client().chat.completions.create(**args)
    one = tiny.client().chat.completions.create(parallel_tool_calls=False, **args)
    cities = [[json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] for r in (both, one)]
    assert cities == [["Rome", "Oslo"], ["Rome"]]
    assert one.usage.completion_tokens < both.usage.completion_tokens  # the grammar ended it after one call


def test_a_forced_call_streams_its_arguments_as_they_are_written(tiny: Served) -> None:
    args = dict(model="tiny", messages=ROME_OSLO, tools=[WEATHER], tool_choice="required", **greedy())
    whole = tiny.client().chat.completions.create(**args).choices[0].message.tool_calls
    chunks = list(tiny.client().chat.completions.create(stream=True, **args))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    firsts = [p for p in pieces if p.id]
    assert [(p.index, p.type, p.function.name) for p in firsts] == [(0, "function", "get_weather"),
                                                                      (1, "function", "get_weather")]
    streamed = ["".join(p.function.arguments or "" for p in pieces if p.index == k) for k in (0, 1)]
    assert [json.loads(a) for a in streamed] == [json.loads(c.function.arguments) for c in whole]
    assert sum(1 for p in pieces if p.index == 0 and p.function.arguments) > 2  # piece by piece, not whole
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_offered_but_answered_in_text(tiny: Served) -> None:
    client = tiny.client()
    reply = client.chat.completions.create(model="tiny", messages=HELLO, tools=[WEATHER], **greedy())
    assert reply.choices[0].message.content == "Hello there, friend!" and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="tiny", messages=HELLO, tools=[WEATHER], stream=True, **greedy())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there, friend!"


def test_tool_choice_none_hides_the_tools(tiny: Served) -> None:
    reply = tiny.client().chat.completions.create(model="tiny", messages=PARIS, tools=[WEATHER], tool_choice="none",
                                                  **greedy(max_tokens=20))
    assert reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens == len(render_chat(tiny.tokenizer, PARIS, None))


def test_tool_history_is_rendered_and_accepted(tiny: Served) -> None:
    history = PARIS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    text = tiny.tokenizer.decode(render_chat(tiny.tokenizer, history, [WEATHER]))
    assert call_text("Paris") in text and "<tool_response>\n18 C and sunny\n</tool_response>" in text
    reply = tiny.client().chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                                  **greedy(max_tokens=4))
    assert reply.usage.prompt_tokens == len(render_chat(tiny.tokenizer, history, [WEATHER]))
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


def test_forced_tool_calls_follow_the_tools_grammar(tiny: Served) -> None:
    """tool_choice naming a function (or "required") gets a call to it, whatever the model would say."""
    client = tiny.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="tiny", messages=PARIS, tools=[WEATHER], tool_choice=named,
                                           **greedy())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris"}]
    assert reply.usage.completion_tokens > 0
    # Asked to say hello, the model must still call the tool: its arguments are valid JSON of the schema.
    [call] = client.chat.completions.create(model="tiny", messages=HELLO, tools=[WEATHER], tool_choice="required",
                                            **greedy(max_tokens=40)).choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(client.chat.completions.create(model="tiny", messages=PARIS, tools=[WEATHER], tool_choice=named,
                                                 stream=True, stream_options={"include_usage": True}, **greedy()))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed if tc.id] == ["get_weather"]
    assert json.loads("".join(tc.function.arguments for tc in streamed)) == {"city": "Paris"}
    assert chunks[-2].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens > 0
    wait_all_blocks_free(tiny.aengine)


def test_forced_tool_call_with_logprobs_and_n(tiny: Served) -> None:
    short_city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": short_city}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = tiny.client().chat.completions.create(model="tiny", messages=HELLO, tools=[tool], tool_choice=named,
                                                  n=2, temperature=1.0, seed=3, logprobs=True, max_tokens=60)
    for choice in reply.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        assert len(choice.logprobs.content) > 10
    wait_all_blocks_free(tiny.aengine)


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[0-9]{3}-[a-z]{2}", lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ("guided_choice", ["sunny", "rainy day"], lambda text: text in ("sunny", "rainy day")),
    ("guided_json", {"enum": ["north", 7, None]}, lambda text: json.loads(text) in ("north", 7, None)),
    ("structured_outputs", {"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}}, "required": ["n"]},
                            "disable_any_whitespace": True}, lambda text: 1 <= json.loads(text)["n"] <= 9),
    ("guided_grammar", 'root ::= "Paris" | "Rome" | "Oslo"', lambda text: text in ("Paris", "Rome", "Oslo")),
    ("structured_outputs", {"regex": "(yes|no)!"}, lambda text: text in ("yes!", "no!")),
])
def test_vllm_structured_fields_on_both_routes_streamed_or_not(tiny: Served, field: str, value, check) -> None:
    client = tiny.client()
    for seed in (1, 2):
        args = {"model": "tiny", "max_tokens": 30, "temperature": 1.0, "seed": seed, "extra_body": {field: value}}
        text = client.completions.create(prompt="Weather:", **args).choices[0].text
        assert check(text), text
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="Weather:", stream=True, **args))
        assert streamed == text
        chat = client.chat.completions.create(messages=HELLO, **args).choices[0].message.content
        chunks = client.chat.completions.create(messages=HELLO, stream=True, **args)
        assert check(chat) and "".join(c.choices[0].delta.content or "" for c in chunks) == chat
    wait_all_blocks_free(tiny.aengine)


def test_tool_call_parser_edges() -> None:
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    content, [call] = parse_tool_calls('Sure.\n<tool_call>{"name": "f", "arguments": {"x": 1}}')  # unclosed
    assert content == "Sure." and call.name == "f" and json.loads(call.arguments) == {"x": 1}
    streamer = ToolCallStreamer()
    assert streamer.push("Hi <tool") == "Hi "  # a possible tag start is held back
    assert streamer.push("box>") == "<toolbox>"
    assert streamer.push(" <tool_call>{") == " " and streamer.push('"name": "f"}</tool_call>') == ""
    assert [c.name for c in streamer.finish()[1]] == ["f"]


# ------------------------------------------------------------------ errors and auth (tiny model)

def test_auth(tiny: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as wrong:
        tiny.client(key="wrong").models.list()
    assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
    missing = httpx.post(f"{tiny.url}/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{tiny.url}/generate", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{tiny.url}/health").status_code == 200
    assert httpx.get(f"{tiny.url}/metrics").status_code == 200


def test_unknown_model_is_404(tiny: Served) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        tiny.client().chat.completions.create(model="gpt-4", messages=HELLO)
    assert error.value.body["code"] == "model_not_found" and "gpt-4" in error.value.body["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"v": {"type": "string", "minLength": 3, "maxLength": 1}}}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
])
def test_bad_values_are_400(tiny: Served, kwargs: dict, param: str) -> None:
    args = {"model": "tiny", "messages": HELLO} | kwargs
    with pytest.raises(openai.BadRequestError) as error:
        tiny.client().chat.completions.create(**args)
    assert error.value.body["param"] == param and error.value.body["type"] == "invalid_request_error"


def test_an_engine_failure_is_a_500_not_a_hang(tiny: Served, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(tiny.aengine, "generate", broken)
    with pytest.raises(openai.InternalServerError, match="the engine broke"):
        tiny.client(timeout=30).chat.completions.create(model="tiny", messages=HELLO, **greedy(max_tokens=2))


def test_malformed_json_is_400(tiny: Served) -> None:
    response = httpx.post(f"{tiny.url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_context_length_is_400_with_the_numbers(tiny: Served) -> None:
    limit = tiny.aengine.engine.max_model_len
    client = tiny.client()
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[5] * (limit + 10), max_tokens=4)
    assert f"maximum context length is {limit} tokens" in too_long.value.body["message"]
    assert f"{limit + 14} tokens ({limit + 10} in the prompt, 4 in the completion)" in too_long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="tiny", prompt=[5] * 10, max_tokens=limit)
    assert too_many.value.body["code"] == "context_length_exceeded"


def test_bad_requests_leave_running_requests_alone(tiny: Served) -> None:
    client = tiny.client()
    args = dict(model="tiny", prompt=[7, 8, 9, 10], max_tokens=60, extra_body={"ignore_eos": True}, **greedy())
    alone = client.completions.create(**args).choices[0].text
    stream = client.completions.create(stream=True, **args)
    text = next(iter(stream)).choices[0].text
    for bad in ({"temperature": -1}, {"prompt": [5] * 5000}, {"model": "nope"}):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
            client.completions.create(**(args | bad))
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == alone
    wait_all_blocks_free(tiny.aengine)


def test_hanging_up_on_a_plain_request_aborts_it(tiny: Served) -> None:
    aborted = parse_metrics(httpx.get(f"{tiny.url}/metrics").text).get(
        'paged_backend_requests_total{finished_reason="abort"}', 0.0)
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 1000 tokens are done
        httpx.post(f"{tiny.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    wait_all_blocks_free(tiny.aengine)
    after = parse_metrics(httpx.get(f"{tiny.url}/metrics").text)
    assert after['paged_backend_requests_total{finished_reason="abort"}'] == aborted + 1


@pytest.mark.slow  # a serve process on the default model
def test_serve_command_wires_its_flags() -> None:
    """`python -m paged_backend.integrations.server` (what `paged-backend serve` runs) on the default model."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "paged_backend.integrations.server", "--port", str(port), "--api-key", "k2",
               "--served-model-name", "smol", "--num-kv-blocks", "32", "--block-size", "8",
               "--max-seqs-per-request", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while time.time() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.3)
        card = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0).models.list().data[0]
        assert card.id == "smol" and card.model_extra["max_model_len"] == 32 * 8
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        too_many = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k2"},
                              json={"model": "smol", "prompt": "hi", "n": 3})
        assert too_many.status_code == 400 and "at most 2 per request" in too_many.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_truncate_prompt_tokens_on_completions_and_chat(tiny: Served) -> None:
    """The server passes truncate_prompt_tokens to the engine: the answer is the truncated prompt's."""
    headers = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    ids = httpx.post(f"{tiny.url}/tokenize", json={"model": "tiny", "messages": messages}, headers=headers).json()
    tail = ids["tokens"][-5:]

    def complete(route: str, **body) -> dict:
        answer = httpx.post(f"{tiny.url}/v1/{route}", json=greedy(model="tiny", max_tokens=4, **body),
                            headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]

    assert ids["count"] > 5
    alone = complete("completions", prompt=tail)["text"]
    assert complete("completions", prompt=ids["tokens"], truncate_prompt_tokens=5)["text"] == alone
    assert complete("chat/completions", messages=messages, truncate_prompt_tokens=5)["message"]["content"] == alone
    chat = httpx.post(f"{tiny.url}/v1/chat/completions", headers=headers, timeout=60,
                      json=greedy(model="tiny", max_tokens=2, messages=messages, truncate_prompt_tokens=5)).json()
    assert chat["usage"]["prompt_tokens"] == 5  # usage counts the tokens the engine ran
    for route, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": messages})):
        refused = httpx.post(f"{tiny.url}/v1/{route}", json=greedy(model="tiny", truncate_prompt_tokens=0, **body),
                             headers=headers)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
