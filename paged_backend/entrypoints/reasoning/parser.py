"""Reasoning parsers: which markers a model family writes its thinking between, by name.

A reasoning model writes `<think> ... </think>` (or `[THINK] ... [/THINK]`, or gpt-oss's harmony
`analysis` channel) before its answer. A
parser names the markers and whether the thinking is open when no start marker was written (a
DeepSeek-R1 template opens it in the prompt; so may Qwen3's or SmolLM3's, but they usually let the
model write `<think>` itself). Whether a given prompt left the thinking open is read from the prompt
(`opens_thinking`), so one parser serves a template with thinking on and off (`enable_thinking`).

The registry (`get_reasoning_parser`) is the public seam; `detect_reasoning_parser` picks one from a
chat template only when its markers say so unambiguously.
"""

from __future__ import annotations

from typing import Any

from .base import ReasoningParser
from ..harmony.reasoning import HARMONY, mentions_channels

THINK = {"start": "<think>", "end": "</think>"}
PARSERS: dict[str, ReasoningParser] = {
    # DeepSeek-R1 and its distills: the template opens <think> in the prompt; the answer follows </think>.
    "deepseek_r1": ReasoningParser("deepseek_r1", **THINK, open_by_default=True),
    # Qwen3, QwQ, SmolLM3 and others writing <think> themselves (or opened by the prompt, which is read).
    "qwen3": ReasoningParser("qwen3", **THINK),
    # Mistral's Magistral: [THINK] ... [/THINK].
    "mistral": ReasoningParser("mistral", start="[THINK]", end="[/THINK]"),
    # gpt-oss: harmony's analysis channel is the thinking, its final channel the answer (harmony/reasoning.py).
    "harmony": HARMONY,
}
AUTO, NONE = "auto", "none"


def reasoning_parser_names() -> list[str]:
    return sorted(PARSERS)


def get_reasoning_parser(name: str, field: str = "reasoning_parser") -> ReasoningParser:
    """The parser registered as `name`; a ValueError naming `field` and the known names otherwise."""
    try:
        return PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{field}={name!r} is not a reasoning parser; known: {reasoning_parser_names()} "
                         f"(or {AUTO!r}, {NONE!r})") from None


def detect_reasoning_parser(chat_template: Any) -> ReasoningParser | None:
    """The parser a chat template's markers name, or None when it names none or more than one."""
    if not isinstance(chat_template, str):
        return None
    found = {p.start for p in PARSERS.values()
             if p is not HARMONY and p.start in chat_template and p.end in chat_template}
    if mentions_channels(chat_template):
        return HARMONY if not found else None
    if found == {"<think>"} and "｜Assistant｜" in chat_template:
        # DeepSeek's templates: some versions open <think> in the prompt, older ones leave the model to
        # think without writing it; both close it with </think>.
        return PARSERS["deepseek_r1"]
    if found == {"<think>"}:
        return PARSERS["qwen3"]  # reads from each prompt whether the template opened the thinking
    if found == {"[THINK]"}:
        return PARSERS["mistral"]
    return None


def resolve_reasoning_parser(name: str | None, tokenizer: Any, field: str = "reasoning_parser") -> ReasoningParser | None:
    """`name` as a front end's option: None or "none" for no parsing, "auto" for the template's own
    markers (when unambiguous), else a registered name."""
    if name is None or name == NONE:
        return None
    if name == AUTO:
        return detect_reasoning_parser(getattr(tokenizer, "chat_template", None))
    return get_reasoning_parser(name, field)
