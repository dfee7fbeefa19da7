"""The documentation site builds with `mkdocs build --strict` (a broken link or anchor fails it), its
generated sections match the code and the results files they come from, and its Architecture page is
ARCHITECTURE.md."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import charts
import docs_reference

pytest.importorskip("mkdocs")
pytest.importorskip("material")


def build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml"),
                           "-d", str(site)], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def copy_project(to: Path) -> Path:
    for name in ("mkdocs.yml", "ARCHITECTURE.md"):
        shutil.copy(ROOT / name, to / name)
    shutil.copytree(ROOT / "docs", to / "docs")
    shutil.copytree(ROOT / "tools", to / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    return to


def test_site_builds_strictly(tmp_path: Path) -> None:
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    architecture = (tmp_path / "site" / "architecture" / "index.html").read_text(encoding="utf-8")
    # The page is ARCHITECTURE.md itself: a heading of its own appears on the site.
    assert "Data flow of one step" in architecture and "include ARCHITECTURE.md" not in architecture


@pytest.mark.parametrize("link", ["[gone](no-such-page.md)", "[gone](configuration.md#no-such-heading)"])
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str) -> None:
    project = copy_project(tmp_path)
    index = project / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + f"\nSee {link}.\n", encoding="utf-8")
    result = build(project, tmp_path / "site")
    assert result.returncode != 0
    assert link.split("(")[1].rstrip(")").split("#")[0] in result.stdout + result.stderr


def test_generated_reference_matches_the_code() -> None:
    """configuration.md and models.md: run `python tools/docs_reference.py` after changing the code."""
    assert docs_reference.stale_sections() == []


def test_generated_results_match_the_results_files() -> None:
    """benchmarks.md and the README: run `python benchmarks/charts.py` after changing a results file."""
    assert charts.stale_sections() == []


def test_reference_names_every_field_and_flag() -> None:
    import dataclasses

    from paged_backend import EngineConfig, SamplingParams

    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for cls in (EngineConfig, SamplingParams):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in page, field.name
    for flag in ("--block-size", "--no-enable-prefix-caching", "--api-key", "--lora-modules", "--temperature"):
        assert flag in page, flag


def test_models_page_lists_every_supported_type() -> None:
    from paged_backend.model.loading.model_loader import SUPPORTED

    page = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    assert all(f"| `{model_type}` |" in page for model_type in SUPPORTED)


def table_rows_off_their_header(text: str) -> list[str]:
    """Table rows whose cell count differs from their table's header (a stray | splits a cell)."""
    off, cells, fenced = [], None, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            cells = None
            continue
        count = len(re.split(r"(?<!\\)\|", line.strip().strip("|")))
        if cells is None:
            cells = count
        elif count != cells:
            off.append(line)
    return off


def test_table_rows_have_their_headers_cells() -> None:
    assert table_rows_off_their_header("| a | b |\n|---|---|\n| x | y |\n| mean |d| 1 | 2 |\n") == ["| mean |d| 1 | 2 |"]
    for page in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        assert table_rows_off_their_header(page.read_text(encoding="utf-8")) == [], page.name
