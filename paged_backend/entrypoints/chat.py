"""One chat renderer, one tool policy: OpenAI-shaped `messages` (and tools) through the model's chat template.

Used by the server, LangChain's `ChatPaged` and `LLM.chat`, so a conversation is the same prompt
whichever front end sends it. The tool policy:

- a template that renders tools (rendering a probe conversation with a tool changes its text) gets
  the tools, past assistant calls and tool results as they are, and renders them itself;
- any other template (SmolLM2's ChatML, for one) gets the Hermes format written into the
  conversation: the tools described in the system turn (only when the call has tools), past assistant
  calls as `<tool_call>` text and tool results as `<tool_response>` user turns, which is what
  Hermes-style templates render themselves. A model is never silently left without its tools.

Errors are `ChatInputError` (a ValueError naming the message field at fault); content parts other
than text are `UnsupportedContent`, one kind of it.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from paged_backend.image_sources import is_image_part, source_of

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
PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
PROBE_CONVERSATION = [{"role": "user", "content": "hi"}]


class ChatInputError(ValueError):
    """A conversation the renderer cannot take; `field` names the part at fault (e.g. `messages.2.role`)."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


class UnsupportedContent(ChatInputError):
    """A content part this text-only path cannot carry (an image, audio)."""


def render_chat(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None, *,
                add_generation_prompt: bool = True, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None, tokenize: bool = True,
                images: list[Any] | None = None) -> list[int] | str:
    """The conversation as prompt token ids (or its text with `tokenize=False`) under the tool policy. With an
    `images` list, image parts are taken: the template gets an `{"type": "image"}` part where each was (and puts
    the model's image token there), and the list gets their sources, in order; without one they are refused."""
    template = chat_template or (getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)
    if not template:
        raise ChatInputError("this model has no chat template")
    native = renders_tools(tokenizer, chat_template)
    converted = [convert_message(m, i, native, images) for i, m in enumerate(messages)]
    if tools and not native:
        converted = add_tool_prompt(converted, tools)
    try:
        rendered = tokenizer.apply_chat_template(converted, tools=tools if native and tools else None,
                                                 tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                                                 return_dict=False, chat_template=chat_template,
                                                 **(template_kwargs or {}))
    except (TemplateError, TypeError) as exc:  # TypeError: template kwargs naming a reserved argument
        raise ChatInputError(f"the chat template refused these messages: {exc}") from None
    return list(rendered) if tokenize else rendered


_RENDERS_TOOLS: dict[str, bool] = {}  # by template text: a template's answer never changes


def renders_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the template shows tools to the model: a probe conversation renders differently with a
    tool than without. (A template that merely mentions `tools` may still drop them.)"""
    template = chat_template or tokenizer.chat_template
    key = template if isinstance(template, str) else json.dumps(template, sort_keys=True, default=str)
    if key not in _RENDERS_TOOLS:
        _RENDERS_TOOLS[key] = probe_renders_tools(tokenizer, chat_template)
    return _RENDERS_TOOLS[key]


def probe_renders_tools(tokenizer: Any, chat_template: str | None) -> bool:
    def render(tools: list[dict[str, Any]] | None) -> str:
        return tokenizer.apply_chat_template(PROBE_CONVERSATION, tools=tools, tokenize=False,
                                             add_generation_prompt=True, chat_template=chat_template)
    try:
        return render([PROBE_TOOL]) != render(None)
    except (TemplateError, TypeError, ValueError):  # a template that cannot render the probe: take its text's word
        template = chat_template or tokenizer.chat_template
        return isinstance(template, str) and "tools" in template


def convert_message(message: Message, index: int, native_tools: bool, images: list[Any] | None = None) -> Message:
    role = message.get("role")
    if role not in ROLES:
        raise ChatInputError(f"messages[{index}].role must be one of {sorted(ROLES)}, got {role!r}",
                             f"messages.{index}.role")
    if images is not None and role == "user" and any(is_image_part(p) for p in message.get("content") or ()):
        return {"role": role, "content": parts_with_images(message["content"], index, images)}
    content = text_of(message.get("content"), index)
    if role == "developer":
        return {"role": "system", "content": content}
    if role == "assistant" and message.get("tool_calls"):
        return assistant_with_calls(content, message["tool_calls"], native_tools)
    if role == "tool" and not native_tools:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    converted = {"role": role, "content": content}
    if role == "tool":
        converted |= {key: message[key] for key in ("tool_call_id", "name") if message.get(key)}
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
                what = f"messages[{index}].content part of type {kind!r}"
                raise UnsupportedContent(f"{what}: this is a text-only model", what)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatInputError(f"messages[{index}].content must be a string or a list of parts",
                         f"messages.{index}.content")


def parts_with_images(content: list[Any], index: int, images: list[Any]) -> list[dict[str, Any]]:
    """A user message's parts as transformers' chat templates take them (text parts and bare image parts), its
    images' sources appended to `images`."""
    parts = []
    for number, part in enumerate(content):
        if is_image_part(part):
            try:
                images.append(source_of(part))
            except ValueError as exc:
                raise ChatInputError(f"messages[{index}].content[{number}]: {exc}",
                                     f"messages.{index}.content.{number}") from None
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": text_of([part], index)})
    return parts


def assistant_with_calls(content: str, tool_calls: Any, native: bool) -> Message:
    if not isinstance(tool_calls, list):
        raise ChatInputError(f"tool_calls must be a list of tool calls, got {tool_calls!r}")
    calls = [function_of(call) for call in tool_calls]
    if native:
        return {"role": "assistant", "content": content,
                "tool_calls": [with_id({"type": "function", "function": call}, raw)
                               for call, raw in zip(calls, tool_calls)]}
    blocks = [f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>" for call in calls]
    return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}


def with_id(call: Message, raw: Any) -> Message:
    """Templates that pair calls with results by id (Mistral's, for one) need the call's id kept."""
    return {"id": raw["id"], **call} if isinstance(raw, dict) and raw.get("id") else call


def function_of(call: Any) -> dict[str, Any]:
    """{"name", "arguments": dict} from OpenAI's call, whose arguments are a JSON object as a string (or,
    as LangChain hands them, the object itself)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatInputError(f"a tool call must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}"
                             f", got {call!r}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ChatInputError(f"tool call arguments are not valid JSON: {arguments!r}") from None
    if not isinstance(arguments, dict):
        raise ChatInputError(f"tool call arguments must be a JSON object, got {arguments!r}")
    return {"name": function["name"], "arguments": arguments}


def add_tool_prompt(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """The Hermes tool description at the end of the system turn (one is added when there is none)."""
    prompt = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system" and messages[0]["content"]:
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}] + messages[1:]
    if messages and messages[0]["role"] == "system":
        messages = messages[1:]
    return [{"role": "system", "content": prompt}] + messages
