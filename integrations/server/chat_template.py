"""Render an OpenAI `messages` list (with tools) into prompt token ids through the model's chat template.

Templates that know about tools (they mention `tools`) get them natively. For the others (SmolLM2's
ChatML template, for one) the tools are described in the system prompt in the Hermes format, past
assistant calls become `<tool_call>` text and tool results `<tool_response>` user turns, which is
what Hermes-style templates render themselves.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from .errors import bad_request, not_supported

Message = dict[str, Any]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

HERMES_TOOL_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-dict>}}\n</tool_call>"
)


def render_chat(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    native = bool(tools) and template_knows_tools(tokenizer)
    converted = [convert_message(m, i, native) for i, m in enumerate(messages)]
    if tools and not native:
        converted = add_tool_prompt(converted, tools)
    try:
        ids = tokenizer.apply_chat_template(converted, tools=tools if native else None, tokenize=True,
                                            add_generation_prompt=add_generation_prompt, return_dict=False,
                                            **(template_kwargs or {}))
    except (TemplateError, TypeError) as exc:  # TypeError: chat_template_kwargs naming a reserved argument
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None
    return list(ids)


def template_knows_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "tools" in template


def convert_message(message: Message, index: int, native_tools: bool) -> Message:
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"messages[{index}].role must be one of {sorted(ROLES)}, got {role!r}",
                          f"messages.{index}.role")
    content = text_of(message.get("content"), index)
    if role == "developer":
        return {"role": "system", "content": content}
    if role == "assistant" and message.get("tool_calls"):
        return assistant_with_calls(content, message["tool_calls"], native_tools)
    if role == "tool" and not native_tools:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    converted = {"role": role, "content": content}
    if role == "tool" and message.get("tool_call_id"):
        converted["tool_call_id"] = message["tool_call_id"]
    return converted


def text_of(content: Any, index: int) -> str:
    """Message content as text: a string, None, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise not_supported(f"messages[{index}].content part of type {kind!r}", "text-only model")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of parts", f"messages.{index}.content")


def assistant_with_calls(content: str, tool_calls: Any, native: bool) -> Message:
    if not isinstance(tool_calls, list):
        raise bad_request(f"tool_calls must be a list of tool calls, got {tool_calls!r}", "messages")
    calls = [function_of(call) for call in tool_calls]
    if native:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": call} for call in calls]}
    blocks = [f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>" for call in calls]
    return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}


def function_of(call: Any) -> dict[str, Any]:
    """{"name", "arguments": dict} from OpenAI's call, whose arguments are a JSON object as a string."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"a tool call must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}"
                          f", got {call!r}", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise bad_request(f"tool call arguments are not valid JSON: {arguments!r}", "messages") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"tool call arguments must be a JSON object, got {arguments!r}", "messages")
    return {"name": function["name"], "arguments": arguments}


def add_tool_prompt(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    prompt = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system" and messages[0]["content"]:
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}] + messages[1:]
    if messages and messages[0]["role"] == "system":
        messages = messages[1:]
    return [{"role": "system", "content": prompt}] + messages
