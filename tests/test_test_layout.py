"""The test tree keeps its shape: test modules import only the helpers package, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_test_module_imports_another() -> None:
    test_modules = {path.stem for path in TESTS.rglob("test_*.py")}
    offenders = {str(path.relative_to(TESTS)): sorted(imported_names(path) & test_modules)
                 for path in TESTS.rglob("*.py")}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_test_modules_live_in_the_folder_of_their_package() -> None:
    """Only whole-engine tests sit at the top; every other test module is in a package folder."""
    top = sorted(path.name for path in TESTS.glob("test_*.py"))
    assert top == ["test_bad_input.py", "test_benchmark_smoke.py", "test_engine_equivalence.py",
                   "test_engine_shape.py", "test_import_cycles.py", "test_packaging.py",
                   "test_precision_benchmarks.py", "test_startup_plan.py", "test_test_layout.py", "test_tracing.py"]
