"""Request bodies of the OpenAI API (and vLLM's extra fields), validated by pydantic.

Unknown fields are refused (400) rather than ignored, so a client never believes an option took
effect when it did not. Types are strict, as OpenAI's are: "10" is not an integer, 1 is not a
boolean. Fields OpenAI or vLLM define but this server cannot honour are accepted by the schema at
the value that changes nothing (what clients send by default) and refused with a 400 naming them
at any other value (`NEUTRAL_FIELDS`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_backend.integrations.options import defaults
from paged_backend.integrations.options.schema import options_model
from paged_backend.integrations.options.vocabularies import OPENAI

from .errors import APIError, bad_request, not_supported


STRICT = ConfigDict(extra="forbid", strict=True)
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk too


# vLLM fields accepted only at the value that changes nothing here: (neutral values, why others are refused).
NEUTRAL_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search runs on /generate and offline through LLM.beam_search"),
    "length_penalty": ((1.0,), "it only shapes beam search"),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded with spaces between them"),
    "prompt_logprobs": ((None,), "use echo with logprobs on /v1/completions to score the prompt"),
    "allowed_token_ids": ((None,), "use logit_bias"),
    "bad_words": ((None, []), "use logit_bias or stop"),
    "priority": ((0,), "requests are scheduled first come, first served"),
    "logits_processors": ((None,), "no server-side logits processors"),
    "return_tokens_as_token_ids": ((None, False), "logprobs carry token text"),
    "guided_whitespace_pattern": ((None,), ("the grammar engine takes no whitespace pattern; "
                                            "structured_outputs.disable_any_whitespace turns free whitespace off")),
}
CHAT_NEUTRAL_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "the answer never repeats the last message"),
    "continue_final_message": ((False,), "the answer starts a new assistant turn"),
    "add_special_tokens": ((False,), "the chat template places the special tokens"),
    "documents": ((None,), "no retrieval documents in the chat template"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "mm_processor_kwargs": ((None,), "text-only models"),
}
COMPLETION_NEUTRAL_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_special_tokens": ((True,), "a text prompt is tokenized as the tokenizer does by default"),
}


# OpenAI's sampling fields and vLLM's extra ones (temperature, top_p, stop, seed, penalties, top_k, min_p,
# stop_token_ids, ...), generated from the OPENAI table's rows: each row gives its wire type, default and range.
OpenAISamplingOptions = options_model("OpenAISamplingOptions", OPENAI, STRICT)


class SamplingFields(OpenAISamplingOptions):
    """What completions and chat share: the OPENAI table's sampling options (inherited), and the fields
    that are not plain sampling options."""

    model_config = STRICT
    model: str
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100], added to its logit
    user: str | None = None  # an end-user id for the caller's own bookkeeping; it changes no output
    # vLLM's structured outputs: {"json" | "json_object" | "regex" | "choice" | "grammar": ...,
    # "disable_any_whitespace": bool}, or one of the older guided_* fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's fields that this server takes only at their neutral value (see NEUTRAL_FIELDS).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    guided_whitespace_pattern: str | None = None

    neutral_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NEUTRAL_FIELDS

    def check_supported(self) -> None:
        for name, (neutral, why) in self.neutral_fields.items():
            if getattr(self, name) not in neutral:
                raise not_supported(name, f"only {neutral[0]!r} is accepted ({why})")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias maps token ids to biases in [-100, 100]; got {key!r}: {bias}",
                               "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far (with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(defaults.OPENAI["completion_max_tokens"], ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=64)
    suffix: str | None = None
    add_special_tokens: bool = True

    neutral_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NEUTRAL_FIELDS | COMPLETION_NEUTRAL_FIELDS

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise bad_request("best_of > n cannot be streamed: the best samples are known only at the end",
                              "best_of")
        if self.suffix:
            raise not_supported("suffix", "no fill-in-the-middle")


class FunctionSpec(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionSpec


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]


# The shape of one message, for the OpenAPI schema only: messages are checked where they are rendered
# (the chat turn, chat_turn.py), which names the message and field of any error.
MESSAGE_SCHEMA = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [
            {"type": "string"}, {"type": "null"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {
            "type": "object", "required": ["function"],
            "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "properties": {"name": {"type": "string"},
                                                       "arguments": {"type": "string"}}}}}},
    },
}


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": MESSAGE_SCHEMA})
    max_tokens: int | None = Field(defaults.OPENAI["chat_max_tokens"], ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # Reasoning models (docs/reasoning.md): the thinking's token budget, and whether to split it out.
    thinking_token_budget: int | None = Field(None, ge=0)
    include_reasoning: bool = True

    neutral_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NEUTRAL_FIELDS | CHAT_NEUTRAL_FIELDS

    def check_supported(self) -> None:
        super().check_supported()
        if self.forces_tool and not self.tools:
            raise APIError(400, "tool_choice forces a tool call, but no tools were given", "tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The `json_schema` object of a json_schema response format (name, schema, strict), else None."""
        if self.response_format is None or self.response_format.type != "json_schema":
            return None
        return (self.response_format.model_extra or {}).get("json_schema") or {}

    @property
    def wants_json(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    @property
    def forces_tool(self) -> bool:
        return isinstance(self.tool_choice, dict) or self.tool_choice == "required"

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class GenerateRequest(BaseModel):
    """The older `/generate` body: a prompt, `stream`, and SamplingParams fields by their own names."""

    model_config = ConfigDict(extra="allow", strict=True)
    prompt: str | list[int]
    stream: bool = False
    use_beam_search: bool = False
    model: str | None = None  # optional here: the served name or one of its LoRA adapters


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's `/v1/load_lora_adapter` body."""

    model_config = STRICT
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's `/v1/unload_lora_adapter` body."""

    model_config = STRICT
    lora_name: str
