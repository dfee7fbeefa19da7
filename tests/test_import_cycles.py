"""The package's modules import each other without a cycle, function-level imports included, and so do its
parts: the sub-packages (`core`, `model`, `sampling`, ...), the integrations and the top-level modules
(`engine`, `config`, ...) form layers, none importing one that imports it back through any module. Imports
under `if TYPE_CHECKING:` are left out: they name types for annotations and never run."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import paged_backend

PACKAGE = "paged_backend"


def module_files() -> dict[str, Path]:
    """Every module of the installed package by dotted name (the package maps the top-level
    `integrations/` into it, so walk each sub-package's own folder)."""
    found: dict[str, Path] = {}
    roots = {PACKAGE: Path(paged_backend.__file__).parent,
             f"{PACKAGE}.integrations": Path(paged_backend.integrations.__file__).parent}
    for prefix, root in roots.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            found.setdefault(name, path)
    return found


def imported_modules(name: str, path: Path, modules: set[str], type_checking: bool = False) -> set[str]:
    """The package modules `name` imports anywhere in its body (`from a import b` counts `a.b` when
    that is a module)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    targets: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if type_checking else runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                origin = ".".join([*anchor, origin] if origin else anchor)
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                targets.add(submodule if submodule in modules else origin)
    return {t for t in targets if t in modules and t != name}


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of the tree outside `if TYPE_CHECKING:` blocks."""
    nodes, pending = [], [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        nodes.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None (depth-first search, colour marking)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Which package modules each module imports; with `type_checking`, the imports for annotations too."""
    files = module_files()
    return {name: imported_modules(name, path, set(files), type_checking) for name, path in files.items()}


def part_of(module: str) -> str:
    """The part a module belongs to: its sub-package (`paged_backend.core`, `paged_backend.integrations`), or
    itself for a top-level module and for the package root."""
    parts = module.split(".")
    return ".".join(parts[:2])


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between parts: an edge where any module of one imports any module of another."""
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = parts.setdefault(part_of(module), set())
        edges.update(part_of(t) for t in targets)
    for part, edges in parts.items():
        edges.discard(part)
    return parts


def importers_of(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """Which modules of part `source` import part `target` (to name the edges of a cycle)."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if part_of(m) == source
                  for t in targets if part_of(t) == target)


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_parts_have_no_import_cycle() -> None:
    graph = import_graph()
    cycle = find_cycle(part_graph(graph))
    edges = [importers_of(graph, a, b) for a, b in itertools.pairwise(cycle)] if cycle else []
    assert cycle is None, "import cycle between parts: " + " -> ".join(cycle) + f" through {edges}"


def test_the_part_graph_joins_modules_by_part() -> None:
    graph = {"paged_backend.core.a": {"paged_backend.core.b", "paged_backend.config"},
             "paged_backend.core.b": set(),
             "paged_backend.config": {"paged_backend.speculative.c"},
             "paged_backend.speculative.c": {"paged_backend.core.b"}}
    parts = part_graph(graph)
    assert parts["paged_backend.core"] == {"paged_backend.config"}  # within a part is no edge
    assert find_cycle(parts) == ["paged_backend.config", "paged_backend.speculative", "paged_backend.core",
                                 "paged_backend.config"]
    assert find_cycle(graph) is None  # the modules alone have no cycle


def test_entrypoints_import_nothing_of_the_integrations() -> None:
    """The integrations are built on the entrypoints (LLM, AsyncEngine, the EngineClient protocol), never the
    other way round."""
    graph = import_graph()
    assert not importers_of(graph, "paged_backend.entrypoints", "paged_backend.integrations")


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_walk_sees_function_level_imports() -> None:
    graph = import_graph()
    assert "paged_backend.engine" in graph["paged_backend.entrypoints.llm"]
    assert "paged_backend.entrypoints.llm" in graph["paged_backend.integrations.cli"]  # imported inside a function
    assert "paged_backend.startup_plan" not in graph["paged_backend.model.runner_start"]  # TYPE_CHECKING
    assert "paged_backend.startup_plan" in import_graph(type_checking=True)["paged_backend.model.runner_start"]
    assert len(graph) > 60


def test_model_has_no_cycle_even_through_type_checking_imports() -> None:
    """Within `model/` no module names another that imports it back, not even for annotations: such a circle
    means a type sits in the wrong module (as `StepInputs` once did in the runner)."""
    graph = import_graph(type_checking=True)
    model = {name: {t for t in targets if t.startswith("paged_backend.model.")}
             for name, targets in graph.items() if name.startswith("paged_backend.model.")}
    cycle = find_cycle(model)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
