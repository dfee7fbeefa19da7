"""The grammar of one tool's arguments, which every format's forced call holds its arguments to."""

from __future__ import annotations

import json
from typing import Any

from paged_backend.sampling.structured_outputs import reason_of


def arguments_grammar(function: dict[str, Any]) -> str:
    """The EBNF of one tool's arguments object. Compact JSON: a small model given free whitespace may
    spend its tokens on it."""
    import xgrammar

    parameters = function.get("parameters") or {}
    schema = {"type": "object", **parameters} if isinstance(parameters, dict) else parameters
    try:
        return str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except RuntimeError as exc:
        raise ValueError(f"the parameters of tool {function['name']!r} are not a schema the grammar can follow: "
                         f"{reason_of(exc)}") from None
