"""ChatPaged: a LangChain chat model on the shared paged engine.

Each call is one chat turn (`paged_backend/entrypoints/chat_turn.py`, as the server builds it): messages
through the model's chat template (or `chat_template`), tools too (rendered by the template when it can,
else described Hermes style in the system turn), a forced call's or a response format's grammar held
after the thinking. What stays here is LangChain's shape of it: calls as LangChain tool calls (invalid
ones kept), streamed as tool-call chunks. Calls run on the engine's continuous batch, so concurrent
`ainvoke`s and a `batch` share forward passes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
    RunnableConfig,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import (
    convert_to_json_schema,
    convert_to_openai_tool,
)
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict

from paged_backend.entrypoints.answer_reader import AnswerReader
from paged_backend.entrypoints.chat_turn import JSON_FORMATS, ChatTurn, NeedsReasoningModel, build_chat_turn
from paged_backend.image_prompts import ProcessedPrompt
from paged_backend.entrypoints.reasoning import (
    AUTO,
    ReasoningStream,
    reasoning_tokens,
    resolve_reasoning_parser,
)
from paged_backend.entrypoints.structured import check_tool_schemas, chosen_tool_name
from paged_backend.entrypoints.tool_calls import ToolCallStream, resolve_tool_parser
from paged_backend.sampling.sampling_params import SamplingParams

from ..logprobs import chat_logprobs
from .completion import Completion
from .messages import to_chat_dicts
from .options import PagedOptions, merge_stops
from .submit import astream_outputs, run_batch, stream_outputs
from .tool_calls import (
    ContentStreamer,
    ParsedResponse,
    parse_calls,
    parse_with_tokenizer,
    tool_call_chunk,
)


@dataclass(frozen=True, slots=True)
class PreparedCall:
    turn: ChatTurn  # the prompt, the parameters (with any grammar), the budget's processor, the reader
    timeout: float | None
    lora: Any = None  # the LoRA adapter the call answers with (None: the base model)
    own_parser: bool = False  # the tokenizer's response_template parses calls (no format named)

    @property
    def prompt_text(self) -> str:
        return self.turn.prompt_text

    @property
    def reader(self) -> AnswerReader:
        return self.turn.reader

    @property
    def params(self) -> SamplingParams:
        return self.turn.params

    @property
    def processor(self) -> Any:
        return self.turn.processor


@dataclass(slots=True)
class StreamState:
    thinking: ReasoningStream | None
    content: ContentStreamer | None


class ChatPaged(PagedOptions, BaseChatModel):
    """Chat model on paged_backend's continuous-batching engine.

    `ChatPaged()` uses the default model; `ChatPaged(model=hf_model_or_path)` any supported one.
    Construction is cheap: the engine is built, or shared, on the first call."""

    # LangChain's base classes ignore unknown fields; an unknown option here is a mistake to report.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    chat_template: str | None = None
    """A Jinja chat template to use instead of the tokenizer's (e.g. HERMES_TOOL_TEMPLATE)."""
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_parser: str | None = AUTO
    """How the model writes its thinking ("auto": the chat template's markers, when they name one
    format; None or "none": never split). The thinking goes to additional_kwargs["reasoning_content"]
    (so `content_blocks` starts with a reasoning block)."""
    tool_call_parser: str | None = AUTO
    """The format the model writes tool calls in ("auto": the template's, else Hermes)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template, e.g. {"enable_thinking": False}."""
    thinking_token_budget: int | None = None
    """Past this many thinking tokens the end marker is forced and the answer follows."""

    @property
    def _llm_type(self) -> str:
        return "paged-backend-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.resolved_model_name, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "chat_template": self.chat_template}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model")
        params = LangSmithParams(ls_provider="paged_backend", ls_model_type="chat",
                                 ls_model_name=model if isinstance(model, str) else self.resolved_model_name,
                                 ls_temperature=kwargs.get("temperature", self.temperature))
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = merge_stops(self.stop, stop)
        return params

    # ------------------------------------------------------------------ tools and structure

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, parallel_tool_calls: bool = False,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Render `tools` through the chat template; tool_choice "any"/"required" forces a call of some
        tool, a tool's name a call of it. A forced call is one call unless `parallel_tool_calls=True`:
        allowed more, small models tend to repeat the call until max_tokens cuts it. A tool whose schema
        is not a valid JSON schema is a ValueError here, at binding."""
        converted = [convert_to_openai_tool(t) for t in tools]
        check_tool_schemas(converted)
        return self.bind(tools=converted, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **kwargs)

    def with_structured_output(self, schema: dict | type, *, include_raw: bool = False,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               strict: bool | None = None, **kwargs: Any) -> Runnable:
        """function_calling forces one call of a tool shaped like `schema`; json_schema holds the answer to
        the schema; json_mode to any JSON object. The engine constrains every token to the grammar, so an
        answer that ends parses (one cut by max_tokens does not); json_mode does not know the schema, so
        a pydantic schema may still reject its keys. Other keyword arguments are call options bound to
        the model (e.g. `max_tokens`, `frequency_penalty`)."""
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            # One call, by name: the parser reads only the first, and "any" would let the grammar go on
            # to a second call that max_tokens may cut.
            model = self.bind_tools([tool], tool_choice=name, **kwargs,
                                    ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            response_format: dict[str, Any] = {"type": "json_object"}
            if method == "json_schema":
                response_format = {"type": "json_schema", "json_schema": {"schema": convert_to_json_schema(schema)}}
            model = self.bind(response_format=response_format, **kwargs,
                              ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be function_calling, json_schema or json_mode, not {method!r}")
        if not include_raw:
            return model | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=model) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------ batching

    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[AIMessage]:
        """Every conversation in flight at once (the default thread pool feeds only cpu+4 at a time)."""
        configs = get_config_list(config, len(inputs))
        for c in configs:
            c.setdefault("max_concurrency", max(1, len(inputs)))
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    # ------------------------------------------------------------------ generation

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self.prepare(messages, stop, kwargs)
        return self.to_result(call, self.complete_all(call))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self.prepare(messages, stop, kwargs)
        return self.to_result(call, await self.acomplete_all(call))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        # BaseChatModel fires on_llm_new_token for each chunk itself.
        call = self.prepare(messages, stop, kwargs, streaming=True)
        state = self.stream_state(call)
        for output in stream_outputs(self.async_engine, self.encode(call), call.params, call.timeout, call.lora,
                                     call.processor):
            yield from self.to_chunks(call, Completion.of(output), state)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = self.prepare(messages, stop, kwargs, streaming=True)
        state = self.stream_state(call)
        async for output in astream_outputs(self.async_engine, self.encode(call), call.params, call.timeout,
                                             call.lora, call.processor):
            for chunk in self.to_chunks(call, Completion.of(output), state):
                yield chunk

    def complete_all(self, call: PreparedCall) -> list[Completion]:
        """Every sample (n of them) of one request, to the end."""
        for _, output in run_batch(self.async_engine, [self.encode(call)], call.params, call.timeout, call.lora,
                                   call.processor):
            if output.finished:
                return [Completion.of(output, i) for i in range(len(output.outputs))]
        raise AssertionError("the engine ended a request without a finished output")

    async def acomplete_all(self, call: PreparedCall) -> list[Completion]:
        async for output in astream_outputs(self.async_engine, self.encode(call), call.params, call.timeout,
                                             call.lora, call.processor):
            if output.finished:
                return [Completion.of(output, i) for i in range(len(output.outputs))]
        raise AssertionError("the engine ended a request without a finished output")

    # ------------------------------------------------------------------ prompt

    @property
    def tokenizer_(self) -> Any:
        tokenizer = self.async_engine.tokenizer
        if tokenizer is None:
            raise ValueError("ChatPaged needs a tokenizer with a chat template; pass tokenizer=...")
        return tokenizer

    def encode(self, call: PreparedCall) -> list[int] | ProcessedPrompt:
        return call.turn.engine_prompt

    def prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
                streaming: bool = False) -> PreparedCall:
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None) or []
        tool_choice = kwargs.pop("tool_choice", None)
        parallel_tool_calls = kwargs.pop("parallel_tool_calls", False)
        response_format = kwargs.pop("response_format", None)
        template_kwargs = {**(self.chat_template_kwargs or {}), **(kwargs.pop("chat_template_kwargs", None) or {})}
        budget = kwargs.pop("thinking_token_budget", self.thinking_token_budget)
        timeout = self.call_timeout(kwargs)
        lora = self.call_lora(kwargs)
        conversation = to_chat_dicts(messages, images=self.async_engine.image_prompts is not None)
        if response_format is not None and response_format.get("type") not in JSON_FORMATS:
            raise NotImplementedError(f"response_format type {response_format.get('type')!r}")
        shown_tools = tools if tool_choice != "none" else []
        shaped = chosen_tool_name(shown_tools, tool_choice) is not None or response_format is not None
        if shaped and kwargs.get("structured_outputs", self.structured_outputs) is not None:
            raise ValueError("structured_outputs cannot be combined with a forced tool call or a response_format")
        params = self.sampling_params(stop, kwargs, logprobs=self.top_logprobs or 0 if self.logprobs else None)
        if params.num_samples > 1 and streaming:
            raise NotImplementedError("n > 1 or best_of > 1 with streaming")
        try:
            turn = build_chat_turn(self.tokenizer_, conversation, params, tools=tools, tool_choice=tool_choice,
                                   parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                                   reasoning=resolve_reasoning_parser(self.reasoning_parser, self.tokenizer_),
                                   tool_parser=resolve_tool_parser(self.tool_call_parser, self.tokenizer_),
                                   thinking_budget=budget, template_kwargs=template_kwargs,
                                   chat_template=self.chat_template, eos_token_ids=self.async_engine.eos_token_ids,
                                   image_prompts=self.async_engine.image_prompts)
        except NeedsReasoningModel:
            raise ValueError("thinking_token_budget needs a reasoning model: set reasoning_parser") from None
        own_parser = (self.tool_call_parser in (None, AUTO)
                      and getattr(self.tokenizer_, "response_template", None) is not None)
        return PreparedCall(turn, timeout, lora, own_parser)

    # ------------------------------------------------------------------ outputs

    def parse(self, call: PreparedCall, text: str) -> ParsedResponse:
        """The thinking first, then the calls of the answer alone."""
        reader = call.reader
        reasoning, text = reader.split_reasoning(text)
        if not reader.tools:
            parsed = ParsedResponse(content=text)
        elif call.own_parser:
            parsed = parse_with_tokenizer(self.tokenizer_, text, call.prompt_text, reader.tools)
        else:
            parsed = parse_calls(text, reader.tool_parser, reader.tools, reader.prefix)
        parsed.reasoning = reasoning
        return parsed

    def stream_state(self, call: PreparedCall) -> StreamState:
        """With a reasoning parser, the thinking streams apart; with tools, only certain content streams,
        and each call's name and arguments as they are written; what is left comes parsed in the last chunk."""
        reader = call.reader
        thinking = reader.reasoning.stream(reader.opened) if reader.reasoning else None
        if not reader.tools:
            return StreamState(thinking, None)
        if call.own_parser:  # transformers' parser runs on the whole text: hold everything back
            return StreamState(thinking, ContentStreamer(hold=True))
        calls = ToolCallStream(reader.tool_parser, reader.tools, reader.prefix)
        return StreamState(thinking, ContentStreamer(reader.tool_parser, calls, prefix=reader.prefix))

    def to_chunks(self, call: PreparedCall, done: Completion, state: StreamState) -> Iterator[ChatGenerationChunk]:
        finished = done.finish_reason is not None
        delta, reasoning = done.without_eos(done.delta, call.reader.eos_texts) if finished else done.delta, ""
        if state.thinking is not None:
            split = state.thinking.push(delta)
            if finished:
                tail = state.thinking.finish()
                split.reasoning, split.content = split.reasoning + tail.reasoning, split.content + tail.content
            reasoning, delta = split.reasoning, split.content
        streamer = state.content
        delta = delta if streamer is None else streamer.feed(delta)
        extra = {"reasoning_content": reasoning} if reasoning else {}
        if not finished:
            calls = streamer.call_chunks() if streamer is not None else []
            if delta or calls or reasoning:
                yield ChatGenerationChunk(message=AIMessageChunk(content=delta, tool_call_chunks=calls,
                                                                 additional_kwargs=extra))
            return
        if streamer is None:
            yield self.to_final_chunk(call, done, content=delta, calls=[], extra=extra)
            return
        parsed = self.parse(call, done.without_eos(done.text, call.reader.eos_texts))
        calls = streamer.final_call_chunks(parsed) if streamer.calls is not None else self.call_chunks(parsed)
        yield self.to_final_chunk(call, done, content=delta + streamer.finish(parsed.content), calls=calls,
                                  extra=extra)

    def to_final_chunk(self, call: PreparedCall, done: Completion, content: str,
                       calls: list[dict[str, Any]], extra: dict[str, Any]) -> ChatGenerationChunk:
        message = AIMessageChunk(content=content, usage_metadata=self.usage(call, done), additional_kwargs=extra,
                                 response_metadata=self.response_metadata(done), chunk_position="last",
                                 tool_call_chunks=calls)
        return ChatGenerationChunk(message=message)

    @staticmethod
    def call_chunks(parsed: ParsedResponse) -> list[dict[str, Any]]:
        return [tool_call_chunk(c, i) for i, c in enumerate(parsed.tool_calls + parsed.invalid_tool_calls)]

    def to_result(self, call: PreparedCall, dones: list[Completion]) -> ChatResult:
        """One ChatGeneration per sample (n > 1 gives several)."""
        generations = []
        for done in dones:
            parsed = self.parse(call, done.without_eos(done.text, call.reader.eos_texts))
            extra = {"reasoning_content": parsed.reasoning} if parsed.reasoning is not None else {}
            message = AIMessage(content=parsed.content, tool_calls=parsed.tool_calls, additional_kwargs=extra,
                                invalid_tool_calls=parsed.invalid_tool_calls, usage_metadata=self.usage(call, done),
                                response_metadata=self.response_metadata(done))
            generations.append(ChatGeneration(message=message))
        return ChatResult(generations=generations, llm_output={"model_name": self.resolved_model_name})

    def usage(self, call: PreparedCall, done: Completion) -> dict[str, Any]:
        """The sample's usage; a reasoning model's counts its thinking tokens too."""
        reader = call.reader
        if reader.reasoning is None:
            return done.usage
        thought = reasoning_tokens(self.tokenizer_, reader.reasoning, done.token_ids, reader.opened)
        return {**done.usage, "output_token_details": {"reasoning": thought}}

    def response_metadata(self, done: Completion) -> dict[str, Any]:
        metadata = {"model_name": self.resolved_model_name, "finish_reason": done.finish_reason,
                    "model_provider": "paged_backend"}
        if done.logprobs is not None:
            pairs = list(zip(done.token_ids, done.logprobs))
            metadata["logprobs"] = chat_logprobs(self.tokenizer_, pairs, self.top_logprobs or 0)
        return metadata
