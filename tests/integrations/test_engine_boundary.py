"""The server, LangChain and Ray front ends reach the engine through `EngineClient` only: no module of
theirs reads anything behind a client's `.engine` or imports `Engine`, except the few that build an
engine (named below with the reason)."""

from __future__ import annotations

import ast
from pathlib import Path

import paged_backend.integrations

ROOT = Path(paged_backend.integrations.__file__).parent
FRONT_ENDS = ("server", "langchain", "ray")
# Where an engine is built, so the offline Engine is in hand by construction.
BUILDERS = {
    "server/cli.py": "`paged-backend serve` loads the LLM and wraps its engine in an AsyncEngine",
    "langchain/engines.py": "the shared registry builds or adopts each AsyncEngine",
    "ray/replica.py": "each replica actor owns its LLM and AsyncEngine",
}


def front_end_modules() -> list[Path]:
    return sorted(p for part in FRONT_ENDS for p in (ROOT / part).rglob("*.py"))


def engine_reads(tree: ast.AST) -> list[str]:
    """`x.engine.y` reads and imports of the `Engine` class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
            found.append(f"line {node.lineno}: .engine.{node.attr}")
        if isinstance(node, ast.ImportFrom) and any(alias.name == "Engine" for alias in node.names):
            found.append(f"line {node.lineno}: imports Engine")
    return found


def test_front_ends_use_only_the_engine_client():
    offenders = {}
    for path in front_end_modules():
        name = path.relative_to(ROOT).as_posix()
        reads = engine_reads(ast.parse(path.read_text()))
        if reads and name not in BUILDERS:
            offenders[name] = reads
    assert not offenders, offenders


def test_the_check_finds_an_engine_read():
    assert engine_reads(ast.parse("def f(a):\n    return a.engine.kv.queried_tokens\n")) == ["line 2: .engine.kv"]
    assert engine_reads(ast.parse("from paged_backend import AsyncEngine, Engine\n")) == ["line 1: imports Engine"]
