"""A tiny chat model trained in a few seconds to answer a handful of scripted conversations exactly,
so routes that turn an answer into text, tool calls or follow-ups are checked end to end with greedy
decoding: its weather tool, a call it makes, the tool's result and the answer that follows."""

from __future__ import annotations

import json
from typing import Any

import torch

from helpers.server import build_chat_tokenizer, tiny_llama
from paged_backend import LLM
from paged_backend.entrypoints.chat import add_tool_prompt, render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HELLO = [{"role": "user", "content": "Say hello."}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
ROME_OSLO = [{"role": "user", "content": "Weather in Rome and Oslo?"}]
PARIS_CALL = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
PARIS_ANSWERED = PARIS + [{"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
HELLO_ANSWER = "Hello there, friend!"
SUNNY_ANSWER = "It is sunny in Paris."


def call_text(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


# (conversation, answer), every conversation rendered with the WEATHER tool offered.
SCRIPT: list[tuple[list[dict[str, Any]], str]] = [
    (HELLO, HELLO_ANSWER), (PARIS, call_text("Paris")),
    (ROME_OSLO, call_text("Rome") + "\n" + call_text("Oslo")), (PARIS_ANSWERED, SUNNY_ANSWER)]


def scripted_llm(**engine_options: Any) -> LLM:
    tool_prompt = add_tool_prompt([], [WEATHER])[0]["content"]
    corpus = [tool_prompt] * 5 + [answer for _, answer in SCRIPT] * 5 + [m[0]["content"] for m, _ in SCRIPT]
    tokenizer = build_chat_tokenizer(corpus)
    model = tiny_llama(tokenizer)
    rows = [(render_chat(tokenizer, m, [WEATHER]), tokenizer.encode(a) + [tokenizer.eos_token_id]) for m, a in SCRIPT]
    train(model, tokenizer.eos_token_id, rows)
    return LLM(model, tokenizer, **({"num_kv_blocks": 64} | engine_options))


def train(model, pad: int, rows: list[tuple[list[int], list[int]]], max_steps: int = 600) -> None:
    """Fit until greedy decoding reproduces every answer (teacher-forced argmax all right)."""
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), pad)
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
