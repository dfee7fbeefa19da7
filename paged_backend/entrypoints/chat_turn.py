"""One chat turn, built the same way for every chat front end: the server's chat routes
(/v1/chat/completions, /v1/responses, /v1/messages), LangChain's `ChatPaged` and `LLM.chat`.

`build_chat_turn` takes what every front end has, once translated from its own vocabulary: the
messages, the tools and the tool choice, a response format, the model's reasoning and tool-call
formats, the thinking budget and the template's options. In this order it

1. builds the grammar of a forced call (in the tool-call format) or of the response format;
2. asks for JSON in the system turn when a response format wants it, and renders the conversation
   through the shared renderer and its tool policy (`chat.py`);
3. reads whether the prompt left the thinking open;
4. holds the grammar (the forced call's, the format's, or one the sampling parameters already carry)
   to the answer after the thinking: a reasoning model thinks first, in words no grammar admits;
5. keeps special tokens when a marker the reader needs is one (and then strips the decoded EOS);
6. runs the front end's prompt check, if it has one, on the final parameters;
7. builds the logits processor that closes the thinking after the budget.

What comes back is a `ChatTurn`: the prompt, the final sampling parameters, the thinking budget's
processor and the `AnswerReader` that splits the answer into reasoning, content and calls, whole or
streamed. Front ends keep only their wire format: their input translated to these arguments, and the
reader's parts shaped as their answer.

A wrong input is a `ChatTurnError` naming the turn's input at fault (`part`), so each front end can
name its own field; a wrong message is the renderer's `ChatInputError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paged_backend.image_prompts import ImagePrompts, ProcessedPrompt
from paged_backend.sampling.sampling_params import SamplingParams
from paged_backend.sampling.structured_outputs import StructuredOutputsParams

from .answer_reader import AnswerReader
from .chat import ChatInputError, Message, render_chat
from .reasoning import ReasoningParser, after_thinking, budget_processor, prompt_tail
from .reasoning.budget import LogitsProcessor
from .structured import add_json_instruction, forced_tool_spec, response_format_spec
from .tool_calls import ToolParser, keeps_special_tokens

# The turn's inputs a ChatTurnError may name.
TOOLS, RESPONSE_FORMAT, THINKING_BUDGET = "tools", "response_format", "thinking_budget"
JSON_FORMATS = ("json_object", "json_schema")


class ChatTurnError(ValueError):
    """An input the turn cannot take: `part` names it (tools, response_format, thinking_budget), `cause` is
    what refused it."""

    def __init__(self, part: str, cause: Exception) -> None:
        super().__init__(str(cause))
        self.part, self.cause = part, cause


class NeedsReasoningModel(ChatTurnError):
    """A thinking budget for a model without a reasoning parser: each front end says how to name one."""

    def __init__(self) -> None:
        super().__init__(THINKING_BUDGET, ValueError("a thinking budget needs a reasoning model"))


@dataclass(frozen=True, slots=True)
class ChatTurn:
    prompt_text: str  # the rendered conversation, up to the assistant's turn
    prompt_ids: list[int]  # what the engine runs (after the front end's prompt check)
    params: SamplingParams  # the caller's, with the answer's grammar and the markers' decoding
    processor: LogitsProcessor | None  # closes the thinking after the budget; None without one
    reader: AnswerReader  # splits the answer: reasoning, content, tool calls
    images: ProcessedPrompt | None = None  # a conversation with images: the prompt and its images, processed

    @property
    def engine_prompt(self) -> list[int] | ProcessedPrompt:
        """What the engine is given: the prompt's ids, or the processed prompt with its images."""
        return self.images if self.images is not None else self.prompt_ids


def build_chat_turn(tokenizer: Any, messages: list[Message], params: SamplingParams | None = None, *,
                    tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                    parallel_tool_calls: bool = True, response_format: dict[str, Any] | None = None,
                    reasoning: ReasoningParser | None = None, split_reasoning: bool = True,
                    tool_parser: ToolParser | None = None, thinking_budget: int | None = None,
                    template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                    add_generation_prompt: bool = True, eos_token_ids: Sequence[int] = (),
                    keep_markers: bool = True,
                    check_prompt: Callable[[list[int], SamplingParams], list[int]] | None = None,
                    image_prompts: ImagePrompts | None = None) -> ChatTurn:
    """The turn of `messages` (OpenAI-shaped) on this tokenizer's template (or `chat_template`).

    `tools` are shown unless `tool_choice` is "none"; a forced choice (required, any, a tool's name) holds
    the answer to calls in `tool_parser`'s format (Hermes when None), which takes precedence over
    `response_format` (OpenAI's: json_object or json_schema), which takes precedence over a grammar
    `params` already carry. `reasoning`: the model's thinking format, which holds the grammar and the
    budget to the answer whether or not the reader splits the thinking off (`split_reasoning`);
    `tool_parser` None reads no calls. `keep_markers` False leaves `params`' decoding as given (the
    front end recovers the markers itself); `check_prompt` refuses a prompt the engine cannot run and
    returns the ids it will run; `image_prompts` (a model the engine runs images for) takes the image parts of
    user messages through the model's processor."""
    params = params or SamplingParams()
    shown = tools if tools and tool_choice != "none" else None
    forced = refused_as(TOOLS, forced_tool_spec, shown or [], tool_choice, parallel_tool_calls, tool_parser)
    grammar = forced or refused_as(RESPONSE_FORMAT, response_format_spec, response_format) or params.structured_outputs
    images: list[Any] | None = [] if image_prompts is not None else None
    prompt_text = render_chat(tokenizer, with_json_instruction(messages, response_format), shown,
                              add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                              template_kwargs=template_kwargs, tokenize=False, images=images)
    processed = None
    if images:
        try:
            processed = image_prompts.read({"prompt": prompt_text, "multi_modal_data": {"image": images}},
                                           add_special_tokens=False)
        except ValueError as exc:  # an image no one can read, or a model that takes none: the messages' fault
            raise ChatInputError(str(exc)) from None
        prompt_ids = processed.token_ids
    else:
        prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    opened = reasoning is not None and reasoning.opens_thinking(prompt_tail(tokenizer, prompt_ids))
    reader = AnswerReader(reasoning if split_reasoning else None, opened, tool_parser if shown else None, shown,
                          forced is not None, parallel_tool_calls)
    held = hold_after_thinking(grammar, reasoning, opened, forced is not None)
    if held is not params.structured_outputs:
        params = dataclasses.replace(params, structured_outputs=held)
    if keep_markers:
        params, reader = decode_markers(tokenizer, reader, params, eos_token_ids)
    if check_prompt is not None:
        prompt_ids = check_prompt(prompt_ids, params)
    processor = thinking_processor(tokenizer, reasoning, thinking_budget, opened)
    return ChatTurn(prompt_text, prompt_ids, params, processor, reader, processed)


def refused_as(part: str, build: Callable[..., Any], *args: Any) -> Any:
    """`build(*args)`, its refusal a ChatTurnError naming `part`."""
    try:
        return build(*args)
    except (ValueError, TypeError) as exc:
        raise ChatTurnError(part, exc) from None


def with_json_instruction(messages: list[Message], response_format: dict[str, Any] | None) -> list[Message]:
    """The messages, asking for JSON in the system turn when the response format wants it."""
    if (response_format or {}).get("type") not in JSON_FORMATS:
        return messages
    schema = (response_format.get("json_schema") or {}).get("schema")
    return add_json_instruction(messages, schema if isinstance(schema, dict) else None)


def hold_after_thinking(spec: StructuredOutputsParams | None, reasoning: ReasoningParser | None, opened: bool,
                        forced_call: bool) -> StructuredOutputsParams | None:
    """A grammar (a forced call, a JSON format) held to the answer after the thinking: the model thinks
    whether or not its answer is split, so the reasoning format decides."""
    return after_thinking(spec, reasoning, opened, forced_call) if reasoning is not None else spec


def decode_markers(tokenizer: Any, reader: AnswerReader, params: SamplingParams,
                   eos_token_ids: Sequence[int]) -> tuple[SamplingParams, AnswerReader]:
    """Markers the reader reads must survive decoding: keep special tokens when one of them is special
    (then the EOS is decoded too, and the reader strips it)."""
    markers = ((reader.reasoning.markers if reader.reasoning else ())
               + (reader.tool_parser.markers if reader.tool_parser else ()))
    if markers and params.skip_special_tokens and keeps_special_tokens(tokenizer, markers):
        params = dataclasses.replace(params, skip_special_tokens=False)
    if not params.skip_special_tokens:
        eos_texts = tuple(tokenizer.decode([i], skip_special_tokens=False) for i in eos_token_ids)
        reader = dataclasses.replace(reader, eos_texts=eos_texts)
    return params, reader


def thinking_processor(tokenizer: Any, reasoning: ReasoningParser | None, budget: int | None,
                       opened: bool) -> LogitsProcessor | None:
    """The logits processor closing the thinking after `budget` tokens (None: no bound)."""
    if budget is None:
        return None
    if reasoning is None:
        raise NeedsReasoningModel()
    return refused_as(THINKING_BUDGET, budget_processor, tokenizer, reasoning, budget, opened)
