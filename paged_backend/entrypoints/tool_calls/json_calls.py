"""Calls written as JSON objects `{"name": ..., "arguments" | "parameters": {...}}`, as Hermes, Llama 3.x
and Mistral's first format write them: splitting a run of objects, and streaming one as it is written."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .tool_call_tags import partial_close
from .base import ParsedCall, PartialCall

# An object written name first, up to where its arguments begin (a leading "type": "function" allowed).
HEADER = re.compile(r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                    r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    closed: bool  # the object's last brace was written


def scan_objects(text: str, separators: str) -> tuple[list[Piece], str]:
    """The top-level JSON objects of `text`, in order, and whatever stopped the scan ("" when only
    whitespace and `separators` stand between the objects)."""
    pieces: list[Piece] = []
    depth, start, in_string, escaped = 0, -1, False, False
    for i, char in enumerate(text):
        if depth == 0:
            if char == "{":
                depth, start = 1, i
            elif not (char.isspace() or char in separators):
                return pieces, text[i:]
            continue
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                pieces.append(Piece(text[start:i + 1], True))
    if depth > 0:
        pieces.append(Piece(text[start:], False))
    return pieces, ""


def parse_object(body: str) -> ParsedCall:
    """One object: a string `name` and an object of `arguments` (or `parameters`; JSON text accepted)."""
    body = body.strip()
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise TypeError("a call must be a JSON object")
        name, arguments = data["name"], data.get("arguments", data.get("parameters", {}))
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as exc:
        return ParsedCall(body, error=f"{type(exc).__name__}: {exc}")
    return ParsedCall(body, name, arguments)


def partial_object(piece: Piece) -> PartialCall | None:
    """The call an object written so far holds (None until its name is written, or when it is not
    written name first). Its last `}` closes the call, not the arguments: held back until known."""
    header = HEADER.match(piece.text)
    if header is None:
        return None
    arguments = arguments_so_far(piece.text[header.end():], piece.closed)
    return PartialCall(json.loads(header.group(1)), arguments, piece.closed)


def partial_objects(pieces: list[Piece]) -> list[PartialCall]:
    calls = []
    for piece in pieces:
        call = partial_object(piece)
        if call is None:
            break
        calls.append(call)
    return calls


TRAILING_BRACES = re.compile(r"[}\s]*\Z")


def arguments_so_far(text: str, closed: bool) -> str:
    """A name-first call's argument text as written so far, from where its arguments begin. The call's last `}`
    closes the call, not its arguments, so a trailing run of `}` and whitespace (and a partial closing tag) is
    held back until the text goes on or the call closes."""
    if closed:
        text = text.rstrip()
        return text[:-1].rstrip() if text.endswith("}") else text
    text = text[:len(text) - partial_close(text)]
    return text[:TRAILING_BRACES.search(text).start()]
