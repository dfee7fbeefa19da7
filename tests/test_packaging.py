"""Every package folder is in pyproject's package list, and every file the package reads that is not Python in
its package data: either missing is left out of a wheel, while an editable install (what the tests run on)
still finds it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_packaged() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            found.add(".".join([name, *relative.parts]))
    assert sorted(found - set(setuptools["packages"])) == []


def test_every_source_file_beside_the_modules_is_package_data() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = setuptools.get("package-data", {})
    for source in [*(ROOT / "paged_backend").rglob("*.c"), *(ROOT / "paged_backend").rglob("*.cpp")]:
        package = ".".join(["paged_backend", *source.parent.relative_to(ROOT / "paged_backend").parts])
        assert any(source.match(pattern) for pattern in data.get(package, [])), source
