"""A route's thinking option on the served model: the template's `enable_thinking` switch where it has
one, else a thinking budget of 0 to turn the thinking off (/v1/responses' `reasoning.effort`,
/v1/messages' `thinking`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .state import ServerState


@dataclass(frozen=True, slots=True)
class Thinking:
    """What a route's thinking option asks: kwargs for the chat template, and a thinking budget."""

    template_kwargs: dict[str, Any] | None = None
    budget: int | None = None


def thinking_switch(state: ServerState, on: bool, param: str, budget: int | None = None) -> Thinking:
    """Thinking on or off, by the means the served model has: its template's `enable_thinking` switch
    (Qwen3, SmolLM3 and others take it) where the template reads one; off otherwise by a budget of
    0, which closes any thinking at once. On needs a reasoning model (a 400 naming `param`); off on a
    model that is not one asks nothing."""
    if state.reasoning_parser is None:
        if on:
            raise bad_request(f"{param} needs a reasoning model: this server runs no reasoning parser "
                              "(--reasoning-parser)", param)
        return Thinking()
    switch = "enable_thinking" in str(getattr(state.tokenizer, "chat_template", "") or "")
    kwargs = {"enable_thinking": on} if switch else None
    if not on and not switch:
        budget = 0
    return Thinking(kwargs, budget)
