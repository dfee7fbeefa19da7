"""Guided writing for ChatPaged: forced tool calls and schema-shaped answers, written by the shared
guided-JSON writers (`paged_backend.integrations.guided_json`) with the model filling in each value,
one engine request each. `drive`/`adrive` run a writer and add up the requests into one Completion.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..guided_json import Ask, Writer, default_answer
from .completion import Completion

# One value's engine request, given how many tokens earlier values used; None once max_tokens is spent.
Complete = Callable[[Ask, int], Completion | None]


def drive(writer: Writer, complete: Complete, prompt_tokens: int) -> Completion:
    """Run a guided writer: each value it asks for is one engine request (`complete`)."""
    done, spent = None, False
    try:
        ask = next(writer)
        while True:
            step = complete(ask, used(done))
            done, spent, answer = advance(done, spent, ask, step)
            ask = writer.send(answer)
    except StopIteration as end:
        return finish_guided(done, end.value, prompt_tokens, spent)


async def adrive(writer: Writer, complete: Callable[[Ask, int], Awaitable[Completion | None]],
                 prompt_tokens: int) -> Completion:
    done, spent = None, False
    try:
        ask = next(writer)
        while True:
            step = await complete(ask, used(done))
            done, spent, answer = advance(done, spent, ask, step)
            ask = writer.send(answer)
    except StopIteration as end:
        return finish_guided(done, end.value, prompt_tokens, spent)


def used(done: Completion | None) -> int:
    return 0 if done is None else done.usage["output_tokens"]


def advance(done: Completion | None, spent: bool, ask: Ask,
            step: Completion | None) -> tuple[Completion | None, bool, str]:
    """Add one value's request to the call; return the call so far, whether max_tokens ran out, the value."""
    if step is None:  # max_tokens is spent: the value is written without the model, so the JSON closes
        return done, True, default_answer(ask)
    return (step if done is None else done.then(step)), spent, step.text[len(ask.text):]


def finish_guided(done: Completion | None, text: str, prompt_tokens: int, spent: bool) -> Completion:
    reason = "length" if spent else "stop"
    if done is None:  # nothing was left to the model (a tool without parameters, one-option choices)
        return Completion(text, text, reason, {"input_tokens": prompt_tokens, "output_tokens": 0,
                                                "total_tokens": prompt_tokens, "input_token_details": {"cache_read": 0}},
                          [], None)
    return Completion(text, text, reason, done.usage, done.token_ids, done.logprobs)
