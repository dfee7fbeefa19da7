"""Every benchmark writes its results through benchmarks/common.py's `write_results`, which records where
they came from; the committed results follow one naming rule and each carries its provenance."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common

PROVENANCE_FIELDS = {"provenance", "command", "git_commit", "git_dirty", "machine_class", "cpu_model", "cpu_flags",
                     "torch_threads", "torch", "transformers", "load_average_before", "load_average_after"}
# Scripts that write no results file of their own: helpers and the chart/page generator.
NOT_BENCHMARKS = {"common.py", "charts.py"}


def test_written_results_carry_their_provenance(tmp_path: Path) -> None:
    path = common.write_results({"tokens_per_s": 1.5}, "demo", tmp_path / "demo.json")
    record = json.loads(path.read_text())
    assert record["tokens_per_s"] == 1.5
    provenance = record["provenance"]
    assert PROVENANCE_FIELDS <= provenance.keys()
    assert provenance["provenance"] == "recorded at the run by benchmarks/common.py"
    assert provenance["command"].startswith("python ")
    assert len(provenance["git_commit"]) == 40 and isinstance(provenance["git_dirty"], bool)
    assert provenance["machine_class"] == common.machine_class()
    assert provenance["torch_threads"] >= 1 and provenance["transformers"]


def test_default_path_is_the_benchmarks_current_file_for_this_machine_class() -> None:
    assert common.current_results_path("lora") == common.RESULTS_DIR / f"lora_{common.machine_class()}.json"


@pytest.mark.parametrize(("flags", "expected"), [({"avx2", "avx512f", "amx_bf16"}, "avx512"), ({"avx2", "fma"}, "avx2"),
                                                 ({"sse4_2"}, "cpu"), (set(), "cpu")])
def test_machine_class_is_the_widest_vector_extension(flags: set[str], expected: str, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert common.machine_class(flags) == expected


def test_command_line_is_relative_to_the_repository() -> None:
    assert common.command_line([str(BENCHMARKS / "lora.py"), "--json", "a b.json"]) == \
        "python benchmarks/lora.py --json 'a b.json'"


def test_every_benchmark_writes_through_write_results() -> None:
    """A script that wrote its JSON itself would leave a results file without provenance."""
    for script in sorted(BENCHMARKS.glob("*.py")):
        if script.name in NOT_BENCHMARKS:
            continue
        tree = ast.parse(script.read_text())
        calls = {node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                 for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert "write_results" in calls, script.name
        writes = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "attr", None) == "write_text" and "json" in ast.unparse(node.func.value)]
        assert not writes, f"{script.name} writes results JSON itself: {[ast.unparse(w) for w in writes]}"


def test_results_files_follow_the_naming_rule_and_carry_provenance() -> None:
    names = sorted(path.name for path in common.RESULTS_DIR.glob("*.json"))
    assert names
    benchmarks = {script.stem for script in BENCHMARKS.glob("*.py")} - {"common", "charts"}
    for name in names:
        record = json.loads((common.RESULTS_DIR / name).read_text())
        provenance = record.get("provenance")
        assert provenance and PROVENANCE_FIELDS <= provenance.keys(), name
        benchmark, _, machine = name.removesuffix(".json").rpartition("_")
        assert benchmark in benchmarks, name
        assert machine == provenance["machine_class"], name
        assert provenance["command"].startswith(f"python benchmarks/{benchmark}.py"), name
        if provenance["provenance"] == "recorded after the run":
            # What the run did not record stays unknown; the commit that added the file is known.
            assert provenance["git_commit"] is None and len(provenance["added_in_commit"]) == 40, name
