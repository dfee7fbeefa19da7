"""What an assistant turn's text becomes, for every chat-shaped route (`/v1/chat/completions`,
`/v1/responses`, `/v1/messages`): reasoning (when the model thinks), then content and tool calls.

`AnswerPlan` is fixed per request (`plan_answer`): the server's reasoning parser and whether the
prompt opened the thinking, the server's tool-call format, the tools and whether a call was forced.
The thinking is split off first, so tool calls and structured outputs see the answer only; a plain
answer (`AnswerPlan.split`) and a stream (`AnswerStream`) go through the same parsers and split alike.
The routes differ only in the shape they give the parts.

Streaming policy: reasoning and content stream as they come, anything from where the calls begin is
held back; a forced call (`tool_choice` required or named, held to the tools' grammar) streams its
name and arguments as they are written, since it is a call from its first token; a free call is sent
whole once the answer is complete, as only then is it known to be a valid call (an invalid one is
content, never a half-sent call).
A forced answer cut off by max_tokens (`cut_off`) keeps its calls as they streamed, the one cut short
included (marked incomplete), plain or streamed alike, and the finish reason stays the cut
(`finish_reason`): a client must not run a call whose arguments were never finished.

The helpers below set up a request for its plan: `hold_after_thinking` (a grammar holds the answer,
not the thinking), `decode_markers` (markers the parsers read survive decoding), `thinking_switch`
and `thinking_budget` (turning the thinking on or off, and bounding it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from paged_backend.entrypoints.reasoning import (
    ReasoningParser,
    after_thinking,
    budget_processor,
    prompt_tail,
)
from paged_backend.sampling.sampling_params import SamplingParams

from paged_backend.entrypoints.tool_calls.base import CallDelta
from paged_backend.entrypoints.structured import ToolSchemaError, check_tool_schemas
from paged_backend.entrypoints.tool_calls import ToolParser, keeps_special_tokens
from .errors import bad_request
from .state import ServerState
from paged_backend.entrypoints.tool_calls.answer_calls import ToolCall, ToolCallStreamer, cut_tool_calls, parse_tool_calls


@dataclass(slots=True)
class AnswerPlan:
    reasoning: ReasoningParser | None = None
    opened: bool = False  # the prompt left the thinking open
    tool_parser: ToolParser | None = None  # None: no tools in play
    tools: list[dict[str, Any]] | None = None
    forced: bool = False  # a call forced by the grammar (tool_choice required or named)
    parallel: bool = True
    # The text of the end-of-sequence tokens, when special tokens are kept for the markers' sake: the
    # engine then decodes the EOS that ended the answer too, which is no part of it.
    eos_texts: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return self.tool_parser.forced_prefix if self.forced and self.tool_parser else ""

    def text_of(self, completion: Any, text: str) -> str:
        """`text` (the answer, or its last delta) less the EOS that ended it, if it was decoded."""
        if completion.finish_reason == "stop" and completion.stop_reason is None:
            for eos in self.eos_texts:
                if text.endswith(eos):
                    return text[:-len(eos)]
        return text

    def answer_of(self, completion: Any) -> str:
        return self.text_of(completion, completion.text)

    def delta_of(self, output: Any) -> str:
        """A streamed output's new text (less the EOS on its last delta)."""
        return self.text_of(output.outputs[0], output.delta_text) if output.finished else output.delta_text

    def split(self, text: str, cut: bool = False) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a finished answer; `cut`: max_tokens ended it (`cut_off`)."""
        reasoning, content = self.reasoning.split(text, self.opened) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            read = cut_tool_calls if self.forced and cut else parse_tool_calls
            content, calls = read(content, self.tool_parser, self.tools, self.prefix)
            calls = calls if self.parallel else calls[:1]
        if reasoning is not None and not content:
            content = None
        return reasoning, content, calls

    def reasoning_tokens(self, tokenizer: Any, token_ids: list[int]) -> int:
        return self.reasoning.reasoning_tokens(tokenizer, token_ids, self.opened) if self.reasoning else 0

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


def cut_off(completion: Any) -> bool:
    """Whether max_tokens ended the answer."""
    return completion.finish_reason == "length"


def finish_reason(completion: Any, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish reason: `tool_calls` for an answer that ended with calls, but `length` for
    one max_tokens cut, whose last call may be unfinished."""
    return "tool_calls" if calls and not cut_off(completion) else completion.finish_reason


def check_tools(tools: list[dict[str, Any]] | None, schema_field: str) -> None:
    """400 naming `schema_field` (the route's name of a tool's schema, formatted with the tool's index)
    for the first tool whose schema is broken, forced or not."""
    try:
        check_tool_schemas(tools)
    except ToolSchemaError as exc:
        field = schema_field.format(exc.index)
        raise bad_request(f"{field} (tool {exc.name!r}) is not a valid JSON schema: {exc.reason}", field) from None


def plan_answer(state: ServerState, prompt_ids: list[int], tools: list[dict[str, Any]] | None,
                forced: bool = False, parallel: bool = True, split_reasoning: bool = True) -> AnswerPlan:
    """The plan of one request's answer: the server's parsers, `tools` (None or empty: no tool calls
    in play), whether the rendered prompt opened the thinking."""
    thinker = state.reasoning_parser
    opened = thinker is not None and thinker.opens_thinking(prompt_tail(state.tokenizer, prompt_ids))
    return AnswerPlan(thinker if split_reasoning else None, opened, state.tool_parser if tools else None,
                      tools or None, forced, parallel)


@dataclass(slots=True)
class Pieces:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)  # pieces of forced calls, as they are written
    tool_calls: list[ToolCall] = field(default_factory=list)  # on finish: every call of the answer
    streamed: int = 0  # on finish: how many of `tool_calls` went out as pieces (the rest go whole)

    @property
    def unsent_calls(self) -> list[ToolCall]:
        return self.tool_calls[self.streamed:]


class AnswerStream:
    """One streamed answer: `push` gives the pieces safe to send now, `finish` the rest."""

    def __init__(self, plan: AnswerPlan) -> None:
        self.plan = plan
        self.thinking = plan.reasoning.stream(plan.opened) if plan.reasoning else None
        self.tools = ToolCallStreamer(plan.tool_parser, plan.tools, plan.prefix) if plan.tool_parser else None

    def push(self, delta: str) -> Pieces:
        pieces = Pieces()
        if self.thinking is not None:
            split = self.thinking.push(delta)
            pieces.reasoning, delta = split.reasoning, split.content
        pieces.content = self.tools.push(delta) if self.tools else delta
        if self.plan.forced:  # held to the grammar, so a call from its first token: stream it as written
            pieces.calls = self.tools.stream.deltas()
        return pieces

    def finish(self, cut: bool = False) -> Pieces:
        """The rest of the answer; `cut`: max_tokens ended it (`cut_off`)."""
        pieces = Pieces()
        if self.thinking is not None:
            split = self.thinking.finish()
            pieces.reasoning = split.reasoning
            pieces.content = self.tools.push(split.content) if self.tools else split.content
        if self.tools is None:
            return pieces
        late = self.tools.stream.deltas() if self.plan.forced else []
        streamed = self.tools.stream.calls.streamed if self.plan.forced else 0
        rest, calls = ("", self.tools.finish_cut()) if self.plan.forced and cut else self.tools.finish()
        pieces.tool_calls = calls if self.plan.parallel else calls[:1]
        pieces.streamed = min(streamed, len(pieces.tool_calls))
        if streamed:
            pieces.calls = late  # the held-back text was the calls, already sent as such
        else:
            pieces.content += rest
        return pieces


# ------------------------------------------------------------------ setting a request up for its plan


def hold_after_thinking(state: ServerState, plan: AnswerPlan, spec: Any) -> Any:
    """A structured-output spec (a forced call, a JSON format) held to the answer after the thinking:
    the model thinks whether or not its answer is split, so the server's parser decides."""
    thinker = state.reasoning_parser
    return after_thinking(spec, thinker, plan.opened, plan.forced) if thinker is not None else spec


def decode_markers(state: ServerState, plan: AnswerPlan, params: SamplingParams) -> SamplingParams:
    """Markers the parsers read must survive decoding: keep special tokens when one of them is special
    (then the EOS is decoded too, and the plan strips it)."""
    markers = ((plan.reasoning.markers if plan.reasoning else ())
               + (plan.tool_parser.markers if plan.tool_parser else ()))
    if markers and params.skip_special_tokens and keeps_special_tokens(state.tokenizer, markers):
        params = dataclasses.replace(params, skip_special_tokens=False)
    if not params.skip_special_tokens:
        decode = state.tokenizer.decode
        plan.eos_texts = tuple(decode([i], skip_special_tokens=False) for i in state.client.eos_token_ids)
    return params


def thinking_budget(state: ServerState, plan: AnswerPlan, budget: int | None, param: str):
    """The logits processor closing the thinking after `budget` tokens (None: no bound); a 400 naming
    `param` when the server runs no reasoning parser."""
    if budget is None:
        return None
    if state.reasoning_parser is None:
        raise bad_request(f"{param} needs a reasoning model: this server runs no reasoning parser "
                          "(--reasoning-parser)", param)
    try:
        return budget_processor(state.tokenizer, state.reasoning_parser, budget, plan.opened)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


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
