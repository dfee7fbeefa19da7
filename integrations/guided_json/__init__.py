"""Guided JSON: the adapter writes a schema's JSON structure and the model fills in only the values,
each under a rule that keeps it a valid JSON value of the schema's type.

A writer is a generator: it yields an `Ask` (the assistant text so far, the stop strings that end the
value, and the rule its tokens must follow, or None for a free string), is sent back what the model
wrote, and finally returns the whole text. An adapter runs each Ask as one engine request on the prompt
plus the text so far (prefix caching makes each a short prefill), with `value_processor(rule)` as the
request's logits processor. Numbers are held to JSON's number grammar token by token; booleans, enums
and the choice between another array item and "]" are held to their literal options; strings end at
their closing quote and are re-escaped. So the result always parses and has the schema's shape.

Supported: object (every property, in schema order), array (at least one item), string, enum, const,
integer, number, boolean, null, a type or anyOf with one non-null choice, and local `$ref`s (pydantic's
`$defs`). Anything else raises `UnsupportedSchema` naming the keyword, rather than guessing.
Without a schema (json_object), `write_free_object` lets the model choose keys, value types and where
each object or array ends, through the same rules, so the answer is still one valid JSON object.
"""

from .token_rules import (
    NUMBER_TOKENS_MAX,
    TokenVocab,
    allowed_choice_ids,
    allowed_number_ids,
    value_params,
    value_processor,
    vocab_for,
)
from .writers import (
    JSON_INSTRUCTION,
    MAX_FREE_DEPTH,
    MAX_SCHEMA_DEPTH,
    NUMBER_STOPS,
    STRING_STOPS,
    Ask,
    ChoiceRule,
    NumberRule,
    Rule,
    UnsupportedSchema,
    Writer,
    add_json_instruction,
    check_writer,
    choose_writer,
    chosen_tool_name,
    default_answer,
    repair_number,
    resolve_choice,
    value_starts,
    write_free_object,
    write_tool_call,
    write_value,
)

__all__ = [
    "JSON_INSTRUCTION", "MAX_FREE_DEPTH", "MAX_SCHEMA_DEPTH", "NUMBER_STOPS", "NUMBER_TOKENS_MAX", "STRING_STOPS",
    "Ask", "ChoiceRule", "NumberRule", "Rule", "TokenVocab", "UnsupportedSchema", "Writer", "add_json_instruction",
    "allowed_choice_ids", "allowed_number_ids", "check_writer", "choose_writer", "chosen_tool_name",
    "default_answer", "repair_number", "resolve_choice", "value_params", "value_processor", "value_starts",
    "vocab_for", "write_free_object", "write_tool_call", "write_value",
]
