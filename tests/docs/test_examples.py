"""Every ```python block of the documentation (docs/*.md) and of README.md runs: a page's blocks in order,
in one namespace, offline. A block preceded by the line `<!-- skip-test: why -->` is not run (it needs a
server, a hub model or a GPU); a page that holds `<!-- slow-test: why -->` (its examples load the default
model) is marked slow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"<!-- skip-test: (?P<why>[^>]*\S) -->\s*$")
SLOW = re.compile(r"<!-- slow-test: [^>]*\S -->")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, why it is skipped or None) of each ```python block, in page order."""
    blocks = []
    for match in FENCE.finditer(text):
        if match["lang"] != "python":
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        blocks.append((text.count("\n", 0, match.start()) + 1, match["body"], skip["why"] if skip else None))
    return blocks


def page_params() -> list:
    params = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if not any(why is None for _, _, why in python_blocks(text)):
            continue
        marks = [pytest.mark.slow] if SLOW.search(text) else []
        params.append(pytest.param(page, marks=marks, id=str(page.relative_to(ROOT))))
    return params


@pytest.mark.parametrize("page", page_params())
def test_page_examples_run(page: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an example that reaches for a hub would fail here, not download
    monkeypatch.chdir(tmp_path)  # files an example writes land in a scratch folder
    namespace: dict = {"__name__": "__docs_example__"}
    for line, code, why in python_blocks(page.read_text(encoding="utf-8")):
        if why is not None:
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # noqa: S102  (the page's own example)
        except Exception as exc:
            raise AssertionError(f"{page.relative_to(ROOT)}, the python block at line {line} failed: {exc!r}") from exc


def test_blocks_are_found_and_skips_need_a_reason() -> None:
    text = "a\n<!-- skip-test: needs a server -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n", "needs a server"), (7, "y = 2\n", None)]
    # A bare marker without a reason does not skip the block.
    assert python_blocks("<!-- skip-test: -->\n```python\nz = 3\n```\n")[0][2] is None


def test_every_python_block_is_run_or_skipped_with_a_reason() -> None:
    """No example hides in a block the runner does not see (```py, ```python3, an indented fence)."""
    for page in pages():
        text = page.read_text(encoding="utf-8")
        other = [m["lang"] for m in FENCE.finditer(text) if m["lang"] in {"py", "python3", "pycon"}]
        assert not other, f"{page.name}: write ```python so the example is run"
        assert not re.search(r"^[ \t]+```python", text, re.MULTILINE), f"{page.name}: an indented ```python block is not run"
