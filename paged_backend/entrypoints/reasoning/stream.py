"""ReasoningStream: an answer's text, fed as it is generated, split into reasoning and content.

Markers switch between the two (the thinking may open in the prompt, close, and even open again);
the markers themselves go to neither side, so content never shows them. Text that may still become a
marker is held back until the next piece says. Whitespace right after a marker is dropped (models
write `<think>\n` and `</think>\n\n`). A finished answer split at once (`ReasoningParser.split`) runs
the same machine over its whole text, so a stream and a plain answer split alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .parser import ReasoningParser


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningStream:
    """`push(delta)` returns the reasoning and content safe to send now; `finish()` the rest."""

    def __init__(self, parser: ReasoningParser, opened: bool = False) -> None:
        self.parser = parser
        self.thinking = opened
        self.reasoned = opened  # whether any thinking happened (a closed empty one counts)
        self.pending = ""  # text not yet assigned: a possible marker's start
        self.after_marker = opened  # drop whitespace until the next visible character

    def push(self, delta: str) -> Split:
        out = Split()
        text = self.pending + delta
        while text:
            marker, at = self.next_marker(text)
            if marker is None:
                keep = self.partial_marker(text)
                self.emit(out, text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                return out
            self.emit(out, text[:at])
            self.switch(marker)
            text = text[at + len(marker):]
        self.pending = ""
        return out

    def finish(self) -> Split:
        out = Split()
        self.emit(out, self.pending)
        self.pending = ""
        return out

    def next_marker(self, text: str) -> tuple[str | None, int]:
        """The first marker in `text` and where it is (either marker: a stray one is dropped too)."""
        found = [(text.find(m), m) for m in self.parser.markers if m in text]
        if not found:
            return None, -1
        at, marker = min(found)
        return marker, at

    def partial_marker(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some marker."""
        for n in range(min(max(map(len, self.parser.markers)) - 1, len(text)), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.parser.markers):
                return n
        return 0

    def switch(self, marker: str) -> None:
        self.thinking = marker == self.parser.start
        self.reasoned = self.reasoned or self.thinking
        self.after_marker = True

    def emit(self, out: Split, piece: str) -> None:
        if self.after_marker:
            piece = piece.lstrip()
            self.after_marker = not piece
        if self.thinking:
            out.reasoning += piece
        else:
            out.content += piece
