"""Guided writing for ChatPaged: forced tool calls and schema-shaped answers, written by the shared
guided-JSON writers (`paged_backend.integrations.guided_json`) with the model filling in each value,
one engine request each. `drive`/`adrive` run a writer and add up the requests into one Completion.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..guided_json import Ask, Writer
from .completion import Completion


def drive(writer: Writer, complete: Callable[[Ask], Completion], prompt_tokens: int) -> Completion:
    """Run a guided writer: each value it asks for is one engine request (`complete`)."""
    done: Completion | None = None
    try:
        ask = next(writer)
        while True:
            step = complete(ask)
            done = step if done is None else done.then(step)
            ask = writer.send(step.text[len(ask.text):])
    except StopIteration as end:
        return finish_guided(done, end.value, prompt_tokens)


async def adrive(writer: Writer, complete: Callable[[Ask], Awaitable[Completion]], prompt_tokens: int) -> Completion:
    done: Completion | None = None
    try:
        ask = next(writer)
        while True:
            step = await complete(ask)
            done = step if done is None else done.then(step)
            ask = writer.send(step.text[len(ask.text):])
    except StopIteration as end:
        return finish_guided(done, end.value, prompt_tokens)


def finish_guided(done: Completion | None, text: str, prompt_tokens: int) -> Completion:
    if done is None:  # nothing was left to the model (a tool without parameters, one-option choices)
        return Completion(text, text, "stop", {"input_tokens": prompt_tokens, "output_tokens": 0,
                                                "total_tokens": prompt_tokens, "input_token_details": {"cache_read": 0}},
                          [], None)
    return Completion(text, text, "stop", done.usage, done.token_ids, done.logprobs)
