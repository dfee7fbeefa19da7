"""Generated sections of Markdown pages: text between a BEGIN and an END marker that a generator writes
from the code or the results files, so that it cannot drift from them.

    <!-- BEGIN GENERATED name: python tools/docs_reference.py -->
    ...
    <!-- END GENERATED name -->

`fill` replaces every named section's body; `stale` says which sections differ from a fresh generation,
which the tests and the documentation build check.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

SECTION = re.compile(r"(<!-- BEGIN GENERATED (?P<name>[\w-]+): (?P<command>[^>]*?) -->\n)(?P<body>.*?)"
                     r"(<!-- END GENERATED (?P=name) -->)", re.DOTALL)


def fill(text: str, generators: Mapping[str, Callable[[], str]]) -> str:
    """`text` with the body of every section named in `generators` replaced by that generator's output."""
    def replace(match: re.Match[str]) -> str:
        generate = generators.get(match["name"])
        if generate is None:
            return match[0]
        body = generate().rstrip("\n") + "\n"
        return match[1] + body + match[5]

    return SECTION.sub(replace, text)


def section_names(text: str) -> list[str]:
    return [match["name"] for match in SECTION.finditer(text)]


def stale(path: Path, generators: Mapping[str, Callable[[], str]]) -> list[str]:
    """The sections of `path` whose committed body differs from a fresh generation."""
    text = path.read_text(encoding="utf-8")
    fresh = fill(text, generators)
    if fresh == text:
        return []
    committed = {m["name"]: m["body"] for m in SECTION.finditer(text)}
    return [m["name"] for m in SECTION.finditer(fresh) if committed.get(m["name"]) != m["body"]]


def rewrite(path: Path, generators: Mapping[str, Callable[[], str]]) -> bool:
    """Fill `path`'s sections in place; True when that changed the file."""
    text = path.read_text(encoding="utf-8")
    fresh = fill(text, generators)
    if fresh != text:
        path.write_text(fresh, encoding="utf-8")
    return fresh != text
