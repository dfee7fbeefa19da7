"""OpenAI's harmony format (gpt-oss): an assistant turn as a run of messages, read as it is written.

After the prompt's `<|start|>assistant` a gpt-oss model writes messages such as

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or `<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>`. A header (role, `to=RECIPIENT` before
or after the channel, `<|channel|>NAME`, `<|constrain|>TYPE` or a bare content type) runs up to
`<|message|>`; the body up to `<|end|>`, `<|return|>` or `<|call|>` (a new `<|start|>` or `<|channel|>`
also ends it: a model cut short, or a stop token the engine dropped). The markers are special tokens
of gpt-oss's tokenizer, kept in the decoded text for this reader.

`HarmonyScanner` turns text fed piece by piece into events (a header read, body text, a message's
end), holding back only what may still become a marker; `read_messages` runs it over a whole text.
The reasoning parser (`reasoning.py`) and the tool-call parser (`tool_calls.py`)
both read answers through it, so they agree on where every message begins and ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
TERMINATORS = (END, RETURN, CALL)
BODY_ENDS = (*TERMINATORS, START, CHANNEL)  # a header after a body: the previous message ended unmarked
ROLE = "assistant"
ANALYSIS, FINAL, COMMENTARY = "analysis", "final", "commentary"
FUNCTIONS = "functions."  # the namespace of developer-defined tools in a recipient

RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
CONSTRAINED = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")


@dataclass(frozen=True, slots=True)
class Header:
    channel: str | None  # None: a message written without a header (plain text)
    recipient: str | None  # "functions.get_weather" for a tool call; None for a message to the user
    content_type: str | None
    raw: str  # the header as written, from its `<|start|>` (if any) through `<|message|>`
    at: int = 0  # where `raw` begins in the text fed

    @property
    def is_call(self) -> bool:
        return self.recipient is not None


@dataclass(frozen=True, slots=True)
class Text:
    text: str
    at: int = 0


@dataclass(frozen=True, slots=True)
class End:
    raw: str  # the terminator written ("" when the text ended, or a header followed, without one)
    at: int = 0


Event = Header | Text | End


def parse_header(raw: str) -> Header:
    """The fields of a header's text (either order of recipient and channel; `<|constrain|>json` or a
    bare `json` after the channel)."""
    inner = raw.removeprefix(START).removesuffix(MESSAGE)
    recipient = RECIPIENT.search(inner)
    channel = CHANNEL_NAME.search(inner)
    kind = CONSTRAINED.search(inner)
    if kind is None and channel is not None:  # `commentary json`: a bare word after the channel and recipient
        words = [w for w in inner[channel.end():].split() if not w.startswith("to=")]
        kind = words[-1] if words else None
    else:
        kind = kind.group(1) if kind else None
    return Header(channel.group(1) if channel else "", recipient.group(1) if recipient else None, kind, raw)


def partial_marker(text: str, markers: tuple[str, ...] = MARKERS) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def header_may_follow(text: str) -> bool | None:
    """Whether text between messages is a header: True when it is, False when it is plain text (a
    message without a header), None while it cannot be told yet."""
    rest = text.lstrip()
    if START.startswith(rest):
        return None
    rest = rest.removeprefix(START).lstrip()
    if rest.startswith(ROLE):
        rest = rest[len(ROLE):].lstrip()
    elif ROLE.startswith(rest):
        return None
    if not rest:
        return None
    for opening in (CHANNEL, MESSAGE, "to="):
        if rest.startswith(opening):
            return True
        if opening.startswith(rest):
            return None
    return False


@dataclass(slots=True)
class HarmonyScanner:
    """Text in, events out: `feed(piece)` gives the events the text so far settles, `close()` the rest."""

    header: Header | None = None  # the open message's header; None between messages
    pending: str = ""  # text read but not yet settled
    offset: int = 0  # where `pending` begins in the text fed
    events: list[Event] = field(default_factory=list)

    @classmethod
    def opened(cls, channel: str = ANALYSIS) -> HarmonyScanner:
        """A scanner whose answer starts inside a message the prompt opened (`<|channel|>analysis<|message|>`)."""
        return cls(header=Header(channel, None, None, ""))

    def feed(self, piece: str) -> list[Event]:
        self.pending += piece
        self.events = []
        while self.pending and (self.read_body() if self.header is not None else self.read_header()):
            pass
        return self.events

    def close(self) -> list[Event]:
        """The events of what is left, once the text is complete."""
        self.events = []
        if self.header is None and self.pending:
            kind = header_may_follow(self.pending)
            if kind or (kind is None and self.pending.lstrip()[:2] in ("", "<|")):
                # a header cut short (max_tokens): its message is empty, and the markup no one's text
                self.open(parse_header(self.pending + MESSAGE), len(self.pending))
            else:
                self.open(Header(None, None, None, ""), 0)
        if self.header is not None:
            if self.pending:
                self.events.append(Text(self.pending, self.offset))
            self.events.append(End("", self.offset + len(self.pending)))
        self.offset += len(self.pending)
        self.header, self.pending = None, ""
        return self.events

    def open(self, header: Header, length: int) -> None:
        """A message begins with `header`, the first `length` characters of what is pending."""
        self.header = replace(header, at=self.offset)
        self.events.append(self.header)
        self.take(length)

    def take(self, length: int) -> None:
        self.pending = self.pending[length:]
        self.offset += length

    def read_header(self) -> bool:
        """Between messages: read a header up to `<|message|>`; False when more text is needed."""
        text = self.pending
        stripped = text.lstrip()
        marker = next((m for m in TERMINATORS if stripped.startswith(m)), None)
        if marker is not None:  # a stray terminator (or the space before a header) belongs to no message
            self.take(len(text) - len(stripped) + len(marker))
            return True
        kind = header_may_follow(text)
        if kind is None:
            return False
        if kind is False:
            self.open(Header(None, None, None, ""), 0)
            return True
        at = text.find(MESSAGE)
        if at < 0:
            return False
        self.take(len(text) - len(stripped))
        self.open(parse_header(stripped[:at - (len(text) - len(stripped)) + len(MESSAGE)]),
                  at - (len(text) - len(stripped)) + len(MESSAGE))
        return True

    def read_body(self) -> bool:
        """Inside a message: text up to its end; False when more text is needed."""
        text = self.pending
        found = [(text.find(m), m) for m in BODY_ENDS if m in text]
        if not found:
            keep = partial_marker(text)
            if len(text) > keep:
                self.events.append(Text(text[:len(text) - keep], self.offset))
                self.take(len(text) - keep)
            return False
        at, marker = min(found)
        if at:
            self.events.append(Text(text[:at], self.offset))
            self.take(at)
        closing = marker if marker in TERMINATORS else ""
        self.events.append(End(closing, self.offset))
        self.take(len(closing))
        self.header = None
        return True


@dataclass(slots=True)
class Message:
    header: Header
    body: str = ""
    end: str = ""  # its terminator ("" when the text ended, or a header followed, without one)
    stop: int = 0  # where it ends in the text read (after its terminator)

    @property
    def start(self) -> int:
        return self.header.at

    @property
    def closed(self) -> bool:
        return bool(self.end)


def read_messages(text: str, complete: bool = True, opened: bool = False) -> tuple[list[Message], int]:
    """The messages of `text` and where the settled text ends (the rest may still become a marker or
    a header; nothing is left when `complete`). The last message may be open (`stop` where it ends so far).
    `opened`: the text starts inside an analysis message the prompt opened (its header is not in `text`)."""
    scanner = HarmonyScanner.opened(ANALYSIS) if opened else HarmonyScanner()
    messages: list[Message] = [Message(scanner.header)] if opened else []
    events = scanner.feed(text)
    if complete:
        events = events + scanner.close()
    for event in events:
        if isinstance(event, Header):
            messages.append(Message(event, stop=event.at + len(event.raw)))
        elif isinstance(event, Text):
            messages[-1].body += event.text
            messages[-1].stop = event.at + len(event.text)
        else:
            messages[-1].end = event.raw
            messages[-1].stop = event.at + len(event.raw)
    return messages, scanner.offset
