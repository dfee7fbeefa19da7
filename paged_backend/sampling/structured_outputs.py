"""StructuredOutputsParams: what shape a request's answer must take (vLLM's vocabulary).

Exactly one of `json` (a JSON Schema), `json_object` (any JSON object), `regex`, `choice` (one of
these strings) or `grammar` (EBNF/GBNF in xgrammar's dialect, or Lark) is set. The spec is turned into an
xgrammar `Grammar` when it is validated: that step needs no tokenizer and takes well under a
millisecond, so a malformed schema, regex or grammar is a ValueError at request time, naming what is
wrong. Compiling the grammar against a vocabulary is the engine's business (`grammar.py`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
GrammarKey = tuple[str, str, bool]  # (kind, spec text, any whitespace): what one compiled grammar depends on


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None  # a JSON Schema (text, dict or a pydantic model class)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF, or Lark
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    key: GrammarKey = field(init=False, repr=False, compare=False, default=("", "", True))

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()
        self.key = self.validate()

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """Accept the params object itself or its fields as a dict (what a JSON request carries)."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS) - {"disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; expected one of {list(KINDS)}")
        return cls(**value)

    def validate(self) -> GrammarKey:
        """Raise ValueError naming what is wrong; return the key of the grammar this spec compiles to."""
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(KINDS)}, got {given or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")
        kind = given[0]
        key = (kind, spec_text(kind, getattr(self, kind)), not self.disable_any_whitespace)
        build_grammar(key)  # raises ValueError for a malformed spec; cached, so the engine reuses it
        return key


def spec_text(kind: str, value: Any) -> str:
    """The spec as one canonical string: the grammar cache's key and what xgrammar parses."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(value).__name__}")
        return json.dumps(value)  # property order is the order the answer writes them in
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be True")
        return ""
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return json.dumps(value)
    if not (isinstance(value, str) and value.strip()):
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return value


@functools.lru_cache(maxsize=512)
def build_grammar(key: GrammarKey):
    """The tokenizer-independent xgrammar Grammar of a spec; ValueError with xgrammar's reason if malformed."""
    import xgrammar

    kind, text, any_whitespace = key
    try:
        if kind == "json":
            return xgrammar.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        if kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(text)
        if kind == "choice":
            # A JSON string literal is also a valid EBNF literal (same escapes).
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
        # vLLM's `grammar` takes EBNF/GBNF or Lark; only EBNF defines its rules with "::=".
        return xgrammar.Grammar.from_ebnf(text) if "::=" in text else xgrammar.Grammar.from_lark(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind} is invalid: {reason_of(exc)}") from None


def reason_of(exc: Exception) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
