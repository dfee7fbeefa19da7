"""gpt-oss's harmony format as a reasoning parser: the `analysis` channel is the thinking, the rest the answer.

A harmony answer is a run of messages (messages.py): `analysis` messages go to the
reasoning, `final` messages (and `commentary` written to the user, a preamble before a tool call) to
the content, each without its markup. A message addressed to a recipient (`to=functions.NAME`, a
tool call) is passed to the content whole, markup and all, for the tool-call parser that reads the
answer next; no other markup reaches the content.

The thinking opens with `<|channel|>analysis<|message|>` and closes with `<|end|><|start|>assistant`:
a thinking budget forces that end, after which the model writes the next message's channel itself,
and a grammar held to the answer (`after_thinking`) starts at that channel: a forced call's own header, or
`answer_opening` (`<|channel|>final<|message|>`) before a JSON answer, as gpt-oss writes its answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .messages import (
    ANALYSIS,
    CHANNEL,
    END,
    FINAL,
    MARKERS,
    MESSAGE,
    ROLE,
    START,
    End,
    HarmonyScanner,
    Header,
    Text,
    read_messages,
)
from ..reasoning.base import ReasoningParser
from ..reasoning.stream import Split

OPEN_THINKING = f"{CHANNEL}{ANALYSIS}{MESSAGE}"
CLOSE_THINKING = f"{END}{START}{ROLE}"


@dataclass(frozen=True, slots=True)
class HarmonyParser(ReasoningParser):
    @property
    def markers(self) -> tuple[str, ...]:
        return MARKERS  # every one a special token of gpt-oss's tokenizer: all must survive decoding

    def opens_thinking(self, prompt_tail: str) -> bool:
        """Whether the prompt ends inside an analysis message (`...<|channel|>analysis<|message|>`)."""
        return prompt_tail.rstrip().endswith(OPEN_THINKING)

    def reasoning_tokens(self, tokenizer: Any, token_ids: Sequence[int], opened: bool = False) -> int:
        """The tokens of every analysis message, its header and terminator included: gpt-oss may think again
        after a preamble or a tool's answer, so the thinking is not one span. A token counts where its text
        begins; the `<|start|>assistant` after an analysis message opens the next message and is not counted."""
        pieces = tokenizer.batch_decode([[token] for token in token_ids], skip_special_tokens=False)
        messages, _ = read_messages("".join(pieces), opened=opened)
        spans = [(m.start, m.stop) for m in messages if m.header.channel == ANALYSIS and not m.header.is_call]
        count, at = 0, 0
        for piece in pieces:
            count += any(start <= at < stop for start, stop in spans)
            at += len(piece)
        return count

    def stream(self, opened: bool = False) -> HarmonyStream:
        return HarmonyStream(opened)


class HarmonyStream:
    """`push(delta)` returns the reasoning and content safe to send now; `finish()` the rest."""

    def __init__(self, opened: bool = False) -> None:
        self.scanner = HarmonyScanner.opened(ANALYSIS) if opened else HarmonyScanner()
        self.reasoned = opened  # whether any analysis message was written (an empty one counts)
        self.route = "reasoning" if opened else "content"  # where the open message's text goes
        self.passing = False  # the open message is a call: its markup goes to the content too

    def push(self, delta: str) -> Split:
        return self.split(self.scanner.feed(delta))

    def finish(self) -> Split:
        return self.split(self.scanner.close())

    def split(self, events: list) -> Split:
        out = Split()
        for event in events:
            if isinstance(event, Header):
                self.open(event, out)
            elif isinstance(event, Text):
                self.add(out, event.text)
            elif isinstance(event, End) and self.passing:
                out.content += event.raw
        return out

    def open(self, header: Header, out: Split) -> None:
        self.passing = header.is_call
        thinking = header.channel == ANALYSIS and not header.is_call
        self.reasoned = self.reasoned or thinking
        self.route = "reasoning" if thinking else "content"
        if self.passing:
            out.content += header.raw

    def add(self, out: Split, text: str) -> None:
        if self.route == "reasoning":
            out.reasoning += text
        else:
            out.content += text


HARMONY = HarmonyParser("harmony", start=OPEN_THINKING, end=CLOSE_THINKING, answer_opening=f"{CHANNEL}{FINAL}{MESSAGE}")


def mentions_channels(chat_template: str) -> bool:
    """A chat template that renders harmony's channels (gpt-oss's)."""
    return CHANNEL in chat_template and MESSAGE in chat_template
