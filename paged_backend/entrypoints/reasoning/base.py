"""ReasoningParser: the markers a model family writes its thinking between, and how an answer splits.

A parser names the markers and whether the thinking is open when no start marker was written (a
DeepSeek-R1 template opens it in the prompt). Whether a given prompt left the thinking open is read
from the prompt (`opens_thinking`), so one parser serves a template with thinking on and off. A
format that is not a pair of markers (harmony's channels) subclasses it with its own `stream`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .stream import ReasoningStream


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start: str  # the marker that opens the thinking
    end: str  # the marker that closes it; the answer follows
    open_by_default: bool = False  # thinking without a start marker (the prompt is assumed to open it)
    # What a grammar-held answer (a JSON format, not a tool call) opens with after the thinking: harmony's
    # final-channel header, which gpt-oss writes before any answer; nothing for a pair of markers.
    answer_opening: str = ""

    @property
    def markers(self) -> tuple[str, str]:
        return self.start, self.end

    def opens_thinking(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves the model inside its thinking: its last marker
        is an unclosed start (or, for a parser open by default, no marker closed it)."""
        start, end = prompt_tail.rfind(self.start), prompt_tail.rfind(self.end)
        if start > end:
            return True
        return self.open_by_default and end < 0

    def stream(self, opened: bool = False) -> ReasoningStream:
        """A stream splitting this format's answer as it is written (`push`, `finish`)."""
        from .stream import ReasoningStream

        return ReasoningStream(self, opened)

    def reasoning_tokens(self, tokenizer: Any, token_ids: Sequence[int], opened: bool = False) -> int:
        """How many of an answer's tokens were thinking (usage's `reasoning_tokens`)."""
        from .usage import marked_thinking_tokens

        return marked_thinking_tokens(tokenizer, self, token_ids, opened)

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished answer: the same split a stream gives."""
        stream = self.stream(opened)
        first, second = stream.push(text), stream.finish()
        reasoning = first.reasoning + second.reasoning
        return (reasoning if stream.reasoned else None), first.content + second.content
